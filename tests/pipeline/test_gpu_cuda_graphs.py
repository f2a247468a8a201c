"""Pipeline steps replayed as CUDA graphs (design note 0028) against the same run eager, on GPUs (skipped cleanly
without them): tiny Qwen3 dense trained 6 steps with `PipelineConfig.cuda_graphs` on and off, every schedule at
pp=2 over NCCL (2 GPUs) and the schedules that run at pp=1 on one GPU (1F1B; ZBV and DualPipeV with both stages of
the V on the rank). Step 1 warms up eagerly, step 2 captures, steps 3-6 only replay: the test requires 4 replayed
steps, so a silent fallback fails it. MoE keeps the pipeline eager with its reason (and equals eager exactly).

Tolerances: both runs use the same kernels on the same GPU with TF32 off, replayed graphs launch the kernels they
captured, and the first accumulation into a zeroed static gradient is exact (0 + g = g), so with the eager kernels
(cuBLAS, eager attention and norms: deterministic) the runs must be **bitwise equal**. The only freedom there is
cuBLAS choosing another algorithm for the weight-gradient store's `addmm_` into an existing (zero) gradient than for
the first eager `mm`; it did not on H200 (2026-11-27). The default (Triton) kernels may reduce with atomics, so they
get the bounds of tests/pipeline/test_gpu_pipeline.py (loss 1e-5 relative, grad norm 1e-4 relative, parameters 1e-4
absolute); on H200 they were bitwise equal too. The printed errors show how close the runs are.
"""

import os

import pytest
import torch
from pipeline_workload import EAGER, RunRecord, all_ranks_max, max_param_error, max_relative, pipelined_run
from test_pipeline_parity import SCHEDULES

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.testing import gpu_world_size, run_on_ranks
from d9d.models import DecoderConfig
from d9d.pipeline import PipelineConfig

pytestmark = pytest.mark.gpu

STEPS, ROWS = 6, 8
TOLERANCES = (1e-5, 1e-4, 1e-4)
KERNELS = {"eager": EAGER, "default": DecoderConfig(loss_chunk_size=5)}  # default: Triton kernels on a GPU
TIMEOUT = float(os.environ.get("D9D_GPU_TEST_TIMEOUT", "600"))


def _errors(graphs: RunRecord, eager: RunRecord) -> tuple[float, float, float]:
    params = max_param_error(graphs.params, {name: tensor.cpu() for name, tensor in eager.params.items()})
    return (
        max_relative(graphs.losses, eager.losses),
        max_relative(graphs.grad_norms, eager.grad_norms),
        all_ranks_max(params, torch.device("cuda", torch.cuda.current_device())),
    )


def _cuda_context(pp: int) -> DistributedContext:
    """pp ranks over NCCL with TF32 off (the tolerances assume float32 matmuls)."""
    os.environ["D9D_DEVICE"] = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return DistributedContext.build(MeshDegrees(pp=pp), device="cuda")


def _compare(pp: int, schedules: list[str], families: tuple[str, ...]) -> list[tuple[str, ...]]:
    ctx = _cuda_context(pp)
    results = []
    for family in families:
        for kernels, decoder in KERNELS.items():
            if family != "dense" and kernels != "eager":
                continue
            for schedule in schedules:
                runs = {
                    graphs: pipelined_run(
                        ctx,
                        family,
                        PipelineConfig(schedule=SCHEDULES[schedule], cuda_graphs=graphs),
                        steps=STEPS,
                        global_rows=ROWS,
                        decoder=decoder,
                    )
                    for graphs in (False, True)
                }
                loss, norm, params = _errors(runs[True], runs[False])
                fallback = runs[True].graph_fallback or "-"
                results.append((family, kernels, schedule, loss, norm, params, runs[True].graph_replays, fallback))
    return results


def _check(results: list[tuple[str, ...]], pp: int) -> None:
    loss_tol, norm_tol, param_tol = TOLERANCES
    for family, kernels, schedule, loss, norm, params, replays, fallback in results:
        print(
            f"{schedule} pp={pp} {family} ({kernels} kernels): graphs vs eager loss {loss:.1e} norm {norm:.1e} "
            f"params {params:.1e}, {replays} replayed steps, fallback: {fallback}"
        )
    for family, kernels, schedule, loss, norm, params, replays, fallback in results:
        what = (family, kernels, schedule, loss, norm, params, replays, fallback)
        if family == "dense":
            assert replays == STEPS - 2, what  # warm-up, capture, then only replays
            if kernels == "eager":
                assert loss == 0 and norm == 0 and params == 0, what
            assert loss < loss_tol and norm < norm_tol and params < param_tol, what
        else:  # stays eager: the same computation
            assert replays == 0 and "MoE" in fallback, what
            assert loss == 0 and norm == 0 and params == 0, what


def test_cuda_graphs_match_eager_pp2_every_schedule():
    if gpu_world_size() < 2:
        pytest.skip(f"pp=2 needs 2 GPUs; {gpu_world_size()} visible")
    results = run_on_ranks(
        2, lambda: _compare(2, sorted(SCHEDULES), ("dense",)), init_process_group=False, timeout_seconds=TIMEOUT
    )[0]
    _check(results, 2)


def test_cuda_graphs_match_eager_pp1_v_schedules():
    """Both stages of the V on one rank: same-rank hand-over and split backward, no communication."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    schedules = ["1f1b", "zbv", "dualpipe_v"]
    results = run_on_ranks(
        1, lambda: _compare(1, schedules, ("dense", "moe")), init_process_group=False, timeout_seconds=TIMEOUT
    )[0]
    _check(results, 1)


def _measured_runs() -> tuple[tuple[float, float, float], int, bool]:
    ctx = _cuda_context(2)
    runs = {
        graphs: pipelined_run(
            ctx,
            "dense",
            PipelineConfig(schedule=SCHEDULES["zbv"], cuda_graphs=graphs, measure_costs_at_step=2),
            steps=STEPS,
            global_rows=ROWS,
            decoder=EAGER,
        )
        for graphs in (False, True)
    }
    measured = runs[True].measured_costs is not None and runs[False].measured_costs is not None
    return _errors(runs[True], runs[False]), runs[True].graph_replays, measured


def test_costs_measured_at_step_two_then_replanned_under_cuda_graphs():
    # Step 1 warms the first program up, step 2 is timed (the interpreter, CUDA events), steps 3-6 run the replanned
    # program: warm-up, capture, then 2 replays. Both runs measure their own costs, so their programs may differ in
    # order (the GPU timings are not bitwise reproducible): the default-kernel tolerances, not bitwise equality.
    if gpu_world_size() < 2:
        pytest.skip(f"pp=2 needs 2 GPUs; {gpu_world_size()} visible")
    (loss, norm, params), replays, measured = run_on_ranks(
        2, _measured_runs, init_process_group=False, timeout_seconds=TIMEOUT
    )[0]
    print(f"zbv pp=2 measured at step 2: graphs vs eager loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
    assert measured
    assert replays == STEPS - 4
    loss_tol, norm_tol, param_tol = TOLERANCES
    assert loss < loss_tol and norm < norm_tol and params < param_tol
