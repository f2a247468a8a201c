"""The pipeline parity workload on CUDA + NCCL (run on the GPU machine; skipped cleanly without 2 GPUs): every
schedule at pp = the number of GPUs (2 or 4), tiny Qwen3 dense and MoE, 10 steps against single-process training.

Tolerances: the reference runs on CPU, the pipeline in float32 on GPUs without TF32; different kernels reorder
float32 sums (about 1e-6 relative per op), which ten AdamW steps carry into the parameters: loss 1e-5 relative,
grad norm 1e-4 relative, parameters 1e-4 absolute.
"""

import os

import pytest
import torch
from pipeline_workload import context, errors_against, pipelined_run, shared_reference
from test_pipeline_parity import SCHEDULES

from d9d.core.testing import gpu_world_size, run_on_ranks
from d9d.pipeline import PipelineConfig

pytestmark = pytest.mark.gpu

STEPS, ROWS = 10, 8
# A hang shows each rank's stack after this long (the harness dumps them); D9D_GPU_TEST_TIMEOUT shortens it.
TIMEOUT = float(os.environ.get("D9D_GPU_TEST_TIMEOUT", "600"))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_nccl_pipeline_matches_single_process(schedule):
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"pipeline parallelism on GPUs needs 2 of them; {world} visible")

    def body() -> list[tuple[str, float, float, float]]:
        os.environ["D9D_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ctx = context(world, 1, device="cuda")
        results = []
        for family in ("dense", "moe"):
            record = pipelined_run(
                ctx, family, PipelineConfig(schedule=SCHEDULES[schedule]), steps=STEPS, global_rows=ROWS
            )
            reference = shared_reference(family, steps=STEPS, global_rows=ROWS, device=ctx.device)
            errors = errors_against(record, reference, ctx.device)
            results.append((family, errors.loss, errors.norm, errors.params))
        return results

    for family, loss, norm, params in run_on_ranks(world, body, init_process_group=False, timeout_seconds=TIMEOUT)[0]:
        print(f"{schedule} pp={world} {family}: loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
        assert loss < 1e-5 and norm < 1e-4 and params < 1e-4


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v"])
def test_nccl_pipeline_with_tensor_parallelism_matches_single_process(schedule):
    """pp=2 x tp=2 on 4 GPUs: the stages hand over their sequence shards over NCCL (docs/design/0016), the
    split-backward schedules with the tp collectives in the input pass (amendment 4); MoE with the z-loss only (a tp
    rank's load-balancing loss is its shard's). Same tolerances as above."""
    if gpu_world_size() < 4:
        pytest.skip(f"pp=2 x tp=2 needs 4 GPUs; {gpu_world_size()} visible")

    def body() -> list[tuple[str, float, float, float]]:
        os.environ["D9D_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ctx = context(2, 1, device="cuda", tp=2)
        results = []
        for family in ("dense", "moe_z_loss"):
            config = PipelineConfig(schedule=SCHEDULES[schedule])
            record = pipelined_run(ctx, family, config, steps=STEPS, global_rows=ROWS, fsdp=True)
            reference = shared_reference(family, steps=STEPS, global_rows=ROWS, device=ctx.device)
            errors = errors_against(record, reference, ctx.device)
            results.append((family, errors.loss, errors.norm, errors.params))
        return results

    for family, loss, norm, params in run_on_ranks(4, body, init_process_group=False, timeout_seconds=TIMEOUT)[0]:
        print(f"{schedule} pp=2 x tp=2 {family}: loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
        assert loss < 1e-5 and norm < 1e-4 and params < 1e-4


@pytest.mark.parametrize(("schedule", "attention"), [("1f1b", "ring"), ("zbv", "all_gather")])
def test_nccl_pipeline_with_context_parallelism_matches_single_process(schedule, attention):
    """pp=2 x cp=2 on 4 GPUs: each stage's attention over its cp group and the stages' cp shards over NCCL (design
    0016, amendment 4), the workload of test_pipeline_context_parallel.py. Same tolerances as above."""
    if gpu_world_size() < 4:
        pytest.skip(f"pp=2 x cp=2 needs 4 GPUs; {gpu_world_size()} visible")
    from test_pipeline_context_parallel import pipelined_cp_run
    from test_pipeline_context_parallel import shared_reference as cp_reference

    from d9d.core.dist import DistributedContext, MeshDegrees

    def body() -> list[tuple[str, float, float, float]]:
        os.environ["D9D_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ctx = DistributedContext.build(MeshDegrees(pp=2, cp=2), device="cuda")
        results = []
        for family in ("dense", "moe_z_loss"):
            record = pipelined_cp_run(ctx, family, PipelineConfig(schedule=SCHEDULES[schedule]), attention)
            reference = cp_reference(family, device=ctx.device)
            errors = errors_against(record, reference, ctx.device)
            results.append((family, errors.loss, errors.norm, errors.params))
        return results

    for family, loss, norm, params in run_on_ranks(4, body, init_process_group=False, timeout_seconds=TIMEOUT)[0]:
        print(f"{schedule} {attention} pp=2 x cp=2 {family}: loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
        assert loss < 1e-5 and norm < 1e-4 and params < 1e-4
