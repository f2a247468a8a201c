"""The pretrain and evaluate rank programs on 2 gloo ranks: config file + overrides -> Trainer over token shards ->
resume; the trained model as a self-describing directory that converts to `transformers`; a checkpoint's held-out
loss, perplexity and bits per byte through Inference."""

import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from d9d.core.checkpoint import latest_complete
from d9d.core.data import TokenShardIndex, TokenShardSetWriter
from d9d.flows.jobs.evaluate.program import main as evaluate
from d9d.flows.jobs.pretrain.program import main
from d9d.models.catalogue import read_parameters
from d9d.models.qwen3 import Qwen3DenseParameters
from d9d.states import CheckpointSource
from hf_parity import assert_loads_in_transformers_with_the_same_logits, convert_to_hf

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

TINY_DENSE = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
}  # fmt: skip


@pytest.fixture
def job_file(tmp_path):
    rng = np.random.default_rng(0)
    with TokenShardSetWriter(tmp_path / "shards", dtype="uint16", max_shard_tokens=200) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(0, 96, size=int(rng.integers(3, 30))), num_bytes=10)
    job = {  # the job's `pretrain` section as a user writes it, and the paths the stage resolves
        "stage": {
            "model": {"kind": "qwen3_dense", "parameters": TINY_DENSE, "decoder": {"attention": {"kind": "eager"}}},
            "seq_len": 16, "steps": 6, "global_batch_rows": 4, "microbatch_rows": 1, "checkpoint_every": 3,
            "optimizer": {"kind": "adamw", "lr": 0.003}, "device": "cpu",
        },
        "train_shards": str(tmp_path / "shards"),
        "checkpoints": str(tmp_path / "checkpoints"),
        "tracker": {"kind": "jsonl", "directory": str(tmp_path / "metrics")},
    }  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.distributed(world_size=2, timeout=180)
def test_pretrain_program_trains_checkpoints_and_resumes(job_file):
    root = job_file.parent
    assert main(["--config", str(job_file), "--set", "stage.steps=3"]) == 0
    assert latest_complete(root / "checkpoints").name == "step-00000003"
    assert main(["--config", str(job_file)]) == 0  # resumes at step 3, trains 4..6
    assert latest_complete(root / "checkpoints").name == "step-00000006"
    (metrics,) = (root / "metrics").glob("*.jsonl")  # one run identity across the resume
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.distributed(world_size=2, timeout=300)
def test_the_trained_model_directory_converts_to_transformers_with_the_same_logits(job_file):
    root = job_file.parent
    model = root / "model"
    assert main(["--config", str(job_file), "--set", f"model_output={model}"]) == 0
    dist.barrier()  # rank 0 writes parameters.json
    assert read_parameters(model) == Qwen3DenseParameters(**TINY_DENSE)  # the directory says what it holds
    source = CheckpointSource.open(model)
    assert {meta.shape for meta in source.metas().values()} >= {(96, 32)}  # whole tensors, gathered from FSDP
    converted = root / "hf"
    convert_to_hf(model, converted)  # one command, as docs/flows.md shows it
    if dist.get_rank() == 0:
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
        assert_loads_in_transformers_with_the_same_logits(model, converted, ids)
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout=180)
def test_evaluate_program_reports_loss_perplexity_and_bits_per_byte_of_a_checkpoint(job_file):
    root = job_file.parent
    assert main(["--config", str(job_file), "--set", "stage.steps=3"]) == 0
    job = yaml.safe_load(job_file.read_text())
    config = {"model": job["stage"]["model"], "shards": job["train_shards"], "seq_len": 16, "rows_per_step": 4,
              "device": "cpu", "output": str(root / "eval")}  # fmt: skip
    eval_file = root / "evaluate.yaml"
    if dist.get_rank() == 0:  # one writer: a rank reading while another truncates the file would see it empty
        eval_file.write_text(yaml.safe_dump(config))
    dist.barrier()
    assert evaluate(["--config", str(eval_file), "--set", f"checkpoint={root / 'checkpoints'}"]) == 0
    dist.barrier()  # rank 0 writes the report
    trained = json.loads((root / "eval" / "evaluation.json").read_text())
    assert trained["checkpoint"].endswith("step-00000003")
    assert trained["perplexity"] == pytest.approx(math.exp(trained["loss"]))
    index = TokenShardIndex.read(root / "shards")
    bytes_per_token = index.num_bytes / index.num_tokens
    assert trained["bits_per_byte"] == pytest.approx(trained["loss"] / (math.log(2) * bytes_per_token))
    assert "| loss |" in (root / "eval" / "evaluation.md").read_text()
    assert evaluate(["--config", str(eval_file), "--set", "output=" + str(root / "init")]) == 0
    dist.barrier()
    untrained = json.loads((root / "init" / "evaluation.json").read_text())
    assert untrained["checkpoint"] is None and untrained["tokens"] == trained["tokens"]
    assert untrained["loss"] != trained["loss"]  # the checkpoint's weights were loaded
