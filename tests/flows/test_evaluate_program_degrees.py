"""The evaluate rank program under `degrees.pp`, `cp` and `tp` (4 gloo ranks, a checkpoint of the pretrain program)
gives the held-out loss of data parallelism alone on the same rows.

Tolerance 1e-5 relative: float32 sums in another order (tensor-parallel matmul and vocabulary-parallel loss
reductions, context-parallel online softmax, pipeline stages), nothing else differs.
"""

import json

import pytest
import torch.distributed as dist
import yaml
from test_pretrain_program import job_file  # noqa: F401  (the fixture: token shards and a pretrain job file)

from d9d.flows.jobs.evaluate.program import main as evaluate
from d9d.flows.jobs.pretrain.program import main as pretrain

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

TOLERANCE = 1e-5


@pytest.mark.distributed(world_size=4, timeout=600)
def test_evaluate_under_pp_cp_and_tp_equals_data_parallel_only(job_file):  # noqa: F811
    root = job_file.parent
    assert pretrain(["--config", str(job_file), "--set", "stage.steps=2"]) == 0
    job = yaml.safe_load(job_file.read_text())
    config = {"model": job["stage"]["model"], "shards": job["train_shards"], "seq_len": 16, "rows_per_step": 4,
              "device": "cpu", "output": str(root / "eval"), "checkpoint": str(root / "checkpoints")}  # fmt: skip
    eval_file = root / "evaluate.yaml"
    if dist.get_rank() == 0:
        eval_file.write_text(yaml.safe_dump(config))
    dist.barrier()
    losses = {}
    for name, degree in [("dp4", None), ("pp2", "degrees.pp=2"), ("cp2", "degrees.cp=2"), ("tp2", "degrees.tp=2")]:
        argv = ["--config", str(eval_file), "--set", f"output={root / name}"]
        assert evaluate(argv + (["--set", degree] if degree else [])) == 0
        dist.barrier()  # rank 0 writes the report
        losses[name] = json.loads((root / name / "evaluation.json").read_text())["loss"]
    for name, loss in losses.items():
        assert abs(loss - losses["dp4"]) <= TOLERANCE * losses["dp4"], (name, losses)
