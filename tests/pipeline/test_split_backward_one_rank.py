"""ZBV and DualPipeV at pp=1: both stages of the V on one rank, so the executor runs the split backward (input
gradients, then the weight gradients deferred past later forwards) with no communication at all. They must equal
1F1B at pp=1 (one stage, ordinary backward) on the same device with the same kernels, for 6 steps of tiny Qwen3
dense and Qwen3-MoE with 8 micro-batches of one row. (The Triton kernels on CPU, in Triton's interpreter, are too
slow for a whole run: tests/pipeline/test_split_backward.py runs one stage's split backward through them.)

On CUDA the kernel backends are the defaults: the Triton kernels' custom autograd Functions sit between the stage
input and every weight, besides the chunked loss and the MoE aux-loss attachment (always). Under
torch 2.11 such a node's Python object held its C++ node only weakly, and the executor drops a stage's outputs after
`I`: the weight pass met a freed node ("Attribute 'register_prehook' is invalid for this instance of
_C._FunctionBase"), which `WeightGradientWork.graph_owners` now prevents. This needs one GPU, not two.

Tolerances (float32, TF32 off): the same forwards on the same kernels; only the order of float32 sums in the
backward differs (a parameter gradient is the sum of the weight pass's contributions instead of the full pass's;
the Triton kernels' weight halves are separate kernels from their fused full backward). On CPU the eager kernels
give a few ulps per step (loss 1e-6, grad norm 5e-6 relative, parameters 2e-6 absolute, as the pipeline parity
tests); on CUDA the Triton kernels reduce in other orders and blocks (1e-5, 1e-4, 1e-4, as tests/pipeline/
test_gpu_pipeline.py).
"""

import os

import pytest
import torch
from pipeline_workload import EAGER, max_param_error, max_relative, pipelined_run
from test_pipeline_parity import SCHEDULES

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.testing import run_on_ranks
from d9d.models import DecoderConfig
from d9d.pipeline import PipelineConfig

STEPS, ROWS = 6, 8
TOLERANCES = {"cpu": (1e-6, 5e-6, 2e-6), "cuda": (1e-5, 1e-4, 1e-4)}
KERNELS = {
    "eager": EAGER,
    "default": DecoderConfig(loss_chunk_size=5),  # every backend detected: Triton on a CUDA GPU
    # The LM head's loss gradients computed in forward (design note 0023): each pass returns its saved half.
    "eager-loss-in-forward": EAGER.model_copy(update={"loss_gradients_in_forward": True}),
    "default-loss-in-forward": DecoderConfig(loss_chunk_size=5, loss_gradients_in_forward=True),
}


def _compare(device: str, kernels: str, schedule: str) -> list[tuple[str, float, float, float]]:
    os.environ["D9D_DEVICE"] = device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ctx = DistributedContext.build(MeshDegrees(), device=device)  # type: ignore[arg-type]
    decoder = KERNELS[kernels]
    results = []
    for family in ("dense", "moe"):
        runs = {
            name: pipelined_run(
                ctx, family, PipelineConfig(schedule=SCHEDULES[name]), steps=STEPS, global_rows=ROWS, decoder=decoder
            )
            for name in ("1f1b", schedule)
        }
        split, full = runs[schedule], runs["1f1b"]
        results.append(
            (
                family,
                max_relative(split.losses, full.losses),
                max_relative(split.grad_norms, full.grad_norms),
                max_param_error(split.params, {name: p.cpu() for name, p in full.params.items()}),
            )
        )
    return results


@pytest.mark.parametrize("schedule", ["zbv", "dualpipe_v"])
@pytest.mark.parametrize(
    ("device", "kernels"),
    [
        ("cpu", "eager"),
        ("cpu", "eager-loss-in-forward"),
        pytest.param("cuda", "default", marks=pytest.mark.gpu),
        pytest.param("cuda", "default-loss-in-forward", marks=pytest.mark.gpu),
    ],
)
def test_v_schedule_on_one_rank_equals_one_stage(device, kernels, schedule):
    results = run_on_ranks(1, lambda: _compare(device, kernels, schedule), timeout_seconds=900)[0]
    loss_tol, norm_tol, param_tol = TOLERANCES[device]
    for family, loss, norm, params in results:
        print(f"{schedule} pp=1 on {device} ({kernels}), {family}: loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
        assert loss < loss_tol and norm < norm_tol and params < param_tol, (family, loss, norm, params)
