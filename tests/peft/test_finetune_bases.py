"""The fine-tune rank program on 2 gloo ranks under FSDP from the two bases users bring: a d9d-layout safetensors
directory (what the convert stage writes) and a Hugging Face directory read through its named mapping. Every base
weight comes from the checkpoint (the LoRA adapters are never asked of it), the merged output describes itself
(`parameters.json`), and `d9d convert` of each model directory gives one that `transformers` loads with the same
logits."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from d9d.core.data import TokenShardSetWriter
from d9d.flows.cli import main as d9d
from d9d.flows.jobs.finetune.program import main as finetune
from d9d.models.catalogue import read_parameters
from d9d.models.qwen3 import Qwen3DenseParameters
from d9d.models.random_checkpoint import write_random_hf_checkpoint
from d9d.states import CheckpointSource
from hf_parity import EAGER, assert_loads_in_transformers_with_the_same_logits, convert_to_hf

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

VOCAB = 64
DENSE = Qwen3DenseParameters(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip
LORA = {"kind": "lora", "module_name_pattern": r".*\.self_attn\.(q|v)_proj", "params": {"r": 4, "alpha": 8}}
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))


def _shards(path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with TokenShardSetWriter(path, dtype="uint16", max_shard_tokens=4096) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(0, VOCAB, size=int(rng.integers(20, 40))), num_bytes=40)


def _on_rank_zero(action) -> None:
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def _full_tensors(directory) -> dict[str, torch.Tensor]:
    source = CheckpointSource.open(directory)
    with source.open_reader() as reader:
        return {name: reader.read(name).float() for name in source.metas()}


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("layout", ["d9d", "hf"])
def test_fsdp_lora_fine_tune_from_a_safetensors_base(tmp_path, layout):
    root = tmp_path
    hf, d9d_base = root / "hf-base", root / "d9d-base"

    # Writing and converting checkpoints is collective in a process group: every rank takes part.
    write_random_hf_checkpoint(hf, DENSE, seed=3, dtype=torch.float32)
    # What the convert stage writes: d9d names and a parameters.json recording the model's kind.
    assert d9d(["convert", "--mapping", "qwen3-hf-to-d9d", str(hf), str(d9d_base)]) == 0

    def prepare() -> None:
        _shards(root / "train", seed=1)
        _shards(root / "validation", seed=2)
        base, mapping = (d9d_base, None) if layout == "d9d" else (hf, "qwen3-hf-to-d9d")
        job = {
            "stage": {"peft": LORA, "steps": 4, "global_batch_rows": 4, "microbatch_rows": 2, "checkpoint_every": 2,
                      "optimizer": {"kind": "adamw", "lr": 0.01}, "validation_rows_per_step": 4,
                      "validation_steps": 2, "device": "cpu", "base": str(base), "base_mapping": mapping},
            "model": {"kind": "qwen3_dense", "parameters": DENSE.model_dump(mode="json"), "decoder": EAGER},
            "seq_len": 16, "base": str(base), "train_shards": str(root / "train"),
            "validation_shards": str(root / "validation"), "checkpoints": str(root / "ckpt"),
            "output": str(root / "out"),
        }  # fmt: skip
        (root / "finetune.yaml").write_text(yaml.safe_dump(job))

    _on_rank_zero(prepare)
    assert finetune(["--config", str(root / "finetune.yaml")]) == 0
    dist.barrier()

    merged = root / "out" / "merged"
    assert read_parameters(merged) == DENSE  # the merged output says what it holds
    base, tuned = _full_tensors(d9d_base), _full_tensors(merged)
    assert base.keys() == tuned.keys()
    adapted = {name for name in base if ".self_attn.q_proj." in name or ".self_attn.v_proj." in name}
    for name in base.keys() - adapted:  # every weight without an adapter is the checkpoint's, bit for bit
        assert torch.equal(tuned[name], base[name]), name
    moved = [float((tuned[name] - base[name]).abs().max()) for name in sorted(adapted)]
    assert all(0 < change < 0.1 for change in moved), moved  # a few LoRA steps: small, non-zero changes
    assert json.loads((root / "out" / "finetune.json").read_text())["last_step"] == 4

    if layout == "d9d":  # both model directories the pipeline writes convert to a loadable transformers model
        for directory, converted in ((d9d_base, root / "hf-from-base"), (merged, root / "hf-from-merged")):
            convert_to_hf(directory, converted)
            _on_rank_zero(lambda: assert_loads_in_transformers_with_the_same_logits(directory, converted, IDS))  # noqa: B023
