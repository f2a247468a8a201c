"""pp=2 x tp=2 (4 gloo ranks): tiny Qwen3 dense and Qwen3-MoE (router z-loss; each tp rank's load-balancing loss
is its sequence shard's, see `AUX_LOSSES`), pipelined with tensor + sequence parallelism in every stage, trained 10
steps with 8 one-row micro-batches through the core Trainer under every schedule but GPipe (the split-backward ones,
ZB-H1, ZBV and DualPipeV, included), equal single-process training on the same global batch. Each tp rank sends its
sequence shard `(1, seq / 2, hidden)` to the same tp rank of the next stage; tp runs under FSDP over a
data-parallel mesh of one (FSDP reduces the replicated norms' tensor-parallel gradients).

Tolerances (float32): besides the pipeline's reordering (see test_pipeline_parity.py), tensor parallelism sums in
another order (vocabulary-parallel log-sum-exp, row-parallel reduce-scatters, the norm over tp shards), a few ulps
per op that AdamW's normalisation carries into the parameters, as in tests/parallel/test_tensor_parallel_trainer.py.
Asserted: loss 2e-5 and grad norm 1e-5 relative, parameters 2e-5 absolute; measured worst (printed) is in
docs/parallelism.md.
"""

import pytest
import torch
import torch.distributed as dist
from pipeline_workload import (
    build_meta,
    context,
    errors_against,
    load_initial,
    pipelined_run,
)
from pipeline_workload import shared_reference as reference_of
from test_pipeline_parity import SCHEDULES
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from d9d.core.dist import DistributedContext
from d9d.models import materialize_
from d9d.models.qwen3 import parallelize_qwen3_dense
from d9d.parallel import FsdpConfig
from d9d.pipeline import PipelineConfig, PipelineStage, backward_input, backward_weight, plan_pipeline
from d9d.pipeline.runtime.fsdp_reduction import DeferredReduction, fsdp_roots

STEPS, ROWS = 10, 8
# The 8-rank layout's own addition is FSDP sharding each tp shard over 2 data ranks (the pp x tp path is checked over
# 10 steps under five schedules above); 5 steps still cover the 3-step warm-up and two steps at full rate with AdamW
# state carried, every step's loss and grad norm compared. 8 ranks share 2 cores: each step is the test's cost.
DP2_STEPS = 5
LOSS_RTOL, NORM_RTOL, PARAM_ATOL = 2e-5, 1e-5, 2e-5


def _check(ctx: DistributedContext, schedule: str, steps: int = STEPS) -> None:
    layout = f"pp={ctx.degrees.pp} x dp_shard={ctx.degrees.dp_shard} x tp={ctx.degrees.tp}"
    for family in ("dense", "moe_z_loss"):
        config = PipelineConfig(schedule=SCHEDULES[schedule])
        record = pipelined_run(ctx, family, config, steps=steps, global_rows=ROWS, fsdp=True)
        reference = reference_of(family, steps=steps, global_rows=ROWS)
        losses, norms = [step.losses[0] for step in reference], [step.grad_norms[0] for step in reference]
        errors = errors_against(record, reference)
        loss, norm, params = errors.loss, errors.norm, errors.params
        if dist.get_rank() == 0:
            print(f"{family} {schedule} {layout}: loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
        assert loss < LOSS_RTOL, (record.losses, losses)
        assert norm < NORM_RTOL, (record.grad_norms, norms)
        assert params < PARAM_ATOL


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipe_v"])
@pytest.mark.distributed(world_size=4, timeout=600)
def test_pp2_tp2_matches_single_process(schedule):
    _check(context(pp=2, tp=2), schedule)


@pytest.mark.slow
@pytest.mark.distributed(world_size=8, timeout=900)
def test_pp2_tp2_dp2_matches_single_process():
    """pp=2 x dp_shard=2 x tp=2 on 8 ranks, 1F1B: FSDP shards each tp shard over the 2 data ranks, which take 4 of
    the 8 micro-batches each; the same tolerances, over `DP2_STEPS` steps."""
    _check(context(pp=2, dp_shard=2, tp=2), "1f1b", steps=DP2_STEPS)


@pytest.mark.distributed(world_size=4, timeout=300)
def test_a_tp_stage_holds_a_tp_share_and_hands_over_its_sequence_shard():
    """What tp buys inside a pipeline: each tensor-parallel weight's local shard is 1/tp of it, and the tensor a
    stage hands the next stage is this rank's half of the sequence, not the whole one."""
    ctx = context(pp=2, tp=2)
    stage = PipelineStage(0, 2)
    module = build_meta("dense", stage)
    parallelize_qwen3_dense(module, ctx, FsdpConfig())
    materialize_(module, ctx.device)
    q_proj = module.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert isinstance(q_proj, DTensor)
    assert q_proj.to_local().numel() * 2 == q_proj.numel()
    ids = torch.randint(0, 64, (1, 8))
    out = module(ids).hidden_states
    assert type(out) is torch.Tensor and out.shape == (1, 4, 32)


@pytest.mark.distributed(world_size=2, timeout=300)
def test_split_backward_under_tp_runs_the_tp_collectives_in_the_input_pass():
    """What a split backward must do under tensor + sequence parallelism, on a middle stage (2 layers) under FSDP as
    the executor runs it: the input pass (`I`) runs every tp collective's backward (the reduce-scatter of each region
    entry's all-gather, the all-gather of each row-parallel reduce-scatter, two of each per layer: they sit on the
    path to the stage input), the weight pass (`W`) runs none (each DTensor weight's gradient is a local matmul of
    the saved activation and the captured gradient), and the gradients it leaves equal one full backward's. The
    counts are exact (DTensor's collectives, as `CommDebugMode` sees them); the gradients differ by rounding only
    (fp32, the same ops, 1e-6)."""
    ctx = context(pp=1, tp=2)
    torch.manual_seed(0)
    hidden = torch.randn(1, 8, 32)[:, 4 * ctx.rank : 4 * ctx.rank + 4]  # this tp rank's sequence shard
    grad_out = torch.randn(1, 8, 32)[:, 4 * ctx.rank : 4 * ctx.rank + 4]
    module = build_meta("dense", PipelineStage(1, 4))
    parallelize_qwen3_dense(module, ctx, FsdpConfig())
    materialize_(module, ctx.device)
    load_initial(module, "dense")
    layers = len(module.model.layers)

    out = module(None, hidden_states=hidden.clone().requires_grad_(True)).hidden_states
    out.backward(grad_out)
    expected = {name: param.grad.full_tensor().clone() for name, param in module.named_parameters()}
    module.zero_grad(set_to_none=True)

    reduction = DeferredReduction(fsdp_roots(module))
    reduction.begin()
    x = hidden.clone().requires_grad_(True)
    out = module(None, hidden_states=x).hidden_states
    with CommDebugMode() as input_pass:
        (input_grad,), work = backward_input([out], [grad_out], [x])
    del out
    with CommDebugMode() as weight_pass:
        backward_weight(work)
    reduction.finish()
    gathers = input_pass.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor]
    scatters = input_pass.get_comm_counts()[torch.ops.c10d_functional.reduce_scatter_tensor]
    assert input_grad is not None and gathers == scatters == 2 * layers, dict(input_pass.get_comm_counts())
    assert weight_pass.get_total_counts() == 0, dict(weight_pass.get_comm_counts())
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), expected[name], atol=1e-6, rtol=0)


def test_split_backward_schedules_with_tp_plan_before_ranks_start():
    for kind in ("zb_h1", "zbv", "dualpipe_v"):
        plan_pipeline(PipelineConfig(schedule=SCHEDULES[kind]), pp=2, num_layers=8, num_microbatches=8, tp=2)
    with pytest.raises(ValueError, match=r"tp=0 must be at least 1"):
        plan_pipeline(PipelineConfig(schedule=SCHEDULES["zbv"]), pp=2, num_layers=8, num_microbatches=8, tp=0)
