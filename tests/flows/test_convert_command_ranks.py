"""`d9d convert` inside a process group (every rank calls it, as in a fine-tune rank program): the tensors are
split across the ranks, and the destination's side files (`config.json` or `parameters.json`, and the record of
the files written) have one writer, the first rank. Every rank returns only once the destination is complete, and
an error there reaches every rank instead of leaving the others waiting."""

import json

import pytest
import torch
import torch.distributed as dist

from d9d.flows.cli import main as d9d
from d9d.flows.jobs.convert import command
from d9d.flows.jobs.convert.command import RECORD_FILE
from d9d.models.catalogue import read_parameters, write_parameters
from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.random_checkpoint import write_random_hf_checkpoint

DENSE = Qwen3DenseParameters(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip


def _complete(destination) -> dict:
    """The record, after checking that it lists every file there (and nothing else)."""
    record = json.loads((destination / RECORD_FILE).read_text())
    on_disk = sorted(str(p.relative_to(destination)) for p in destination.rglob("*") if p.is_file())
    assert record["files"] == [name for name in on_disk if name != RECORD_FILE]
    return record


@pytest.mark.distributed(world_size=2, timeout=120)
def test_every_rank_returns_to_a_complete_destination(tmp_path, monkeypatch):
    hf, ours, back = tmp_path / "hf", tmp_path / "d9d", tmp_path / "hf-again"
    records: list[str] = []  # the side files' writes in this process
    write_record = command.write_record
    monkeypatch.setattr(command, "write_record", lambda *args: records.append(args[1]) or write_record(*args))
    write_random_hf_checkpoint(hf, DENSE, seed=3, dtype=torch.float32)
    for _ in range(3):  # rewrites widen the window in which a second writer would truncate a file being read
        assert d9d(["convert", "--overwrite", "--mapping", "qwen3-hf-to-d9d", str(hf), str(ours)]) == 0
        # No barrier here: each rank reads what the command left it.
        assert read_parameters(ours) == DENSE
        assert "parameters.json" in _complete(ours)["files"]
        assert d9d(["convert", "--overwrite", "--mapping", "qwen3-d9d-to-hf", str(ours), str(back)]) == 0
        assert json.loads((back / "config.json").read_text())["hidden_size"] == DENSE.hidden_size
        assert "config.json" in _complete(back)["files"]
    assert not list(tmp_path.rglob("*.tmp"))  # the atomic writes leave no staging file behind
    assert len(records) == (6 if dist.get_rank() == 0 else 0)  # one writer: the first rank, once per conversion


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_failing_config_step_fails_every_rank_with_its_message(tmp_path, capsys):
    hf, ours = tmp_path / "hf", tmp_path / "d9d"
    write_random_hf_checkpoint(hf, DENSE, seed=3, dtype=torch.float32)
    assert d9d(["convert", "--mapping", "qwen3-hf-to-d9d", str(hf), str(ours)]) == 0
    # The tensors are a dense model's, but parameters.json says MoE: only the config step (first rank) can tell.
    moe = Qwen3MoeParameters(**DENSE.model_dump(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if dist.get_rank() == 0:
        write_parameters(ours, moe)
    dist.barrier()
    capsys.readouterr()
    assert d9d(["convert", "--mapping", "qwen3-d9d-to-hf", str(ours), str(tmp_path / "out")]) == 2
    assert "describes a qwen3_moe model; use the qwen3-moe-d9d-to-hf mapping" in capsys.readouterr().err
