"""Context parallelism through the Trainer equals single-process training on the same global batch.

cp=2 x dp_shard=2 on 4 gloo ranks (FSDP over dp_cp_shard), tiny Qwen3 dense and Qwen3-MoE (router z-loss on),
packed documents crossing chunk and rank boundaries, 10 AdamW steps of 2 micro-batches per rank with clipping
active, against one process training on all 4 rows at once with plain full attention. Compared: per-step loss,
grad norm and every final parameter (float32).

Tolerances (float32): loss 1e-5 absolute, grad norm 1e-5 relative, parameters 1e-5 absolute. The sums run in another
order (online-softmax merges, FSDP reduce-scatter, per-shard losses); measured at most 5.2e-7 (loss), 1.7e-7 (grad
norm, relative) and 2.9e-7 (parameters). The MoE case also pins the 1/cp of the auxiliary-loss weight: without it
(weight 1/(micro-batches x dp)) the z-loss would count twice, and that run is checked to differ by far more.

The layout-change resume trains 5 steps under cp=2 x dp_shard=2, checkpoints, and resumes the same job on dp_shard=4
(no cp) for steps 6-10 with the same global batch: those losses equal the single-process run's.
"""

import shutil

import pytest
import torch.distributed as dist
from cp_workload import EAGER, build_cp_trainer, train_distributed, train_reference

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import EventBus, OptimizerStepped
from d9d.parallel import HsdpConfig

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

STEPS = 10
GLOBAL_ROWS = 4  # dp 2 x 2 micro-batches of 1 row
LOSS_TOLERANCE = 1e-5
NORM_TOLERANCE = 1e-5
PARAM_TOLERANCE = 1e-5


def _compare(run, reference) -> dict[str, float]:
    loss = max(abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True))
    norm = max(abs(a - b) / b for a, b in zip(run.grad_norms, reference.grad_norms, strict=True))
    params = max((run.params[name] - value).abs().max().item() for name, value in reference.params.items())
    return {"loss": loss, "grad_norm_rel": norm, "params": params}


@pytest.mark.parametrize("attention", ["ring", "all_gather"])
@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=4, timeout=400)
def test_cp2_dp2_training_equals_one_process(family, attention):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, cp=2), device="cpu")
    run = train_distributed(ctx, family, STEPS, GLOBAL_ROWS, attention)
    if ctx.rank == 0:
        reference = train_reference(family, STEPS, GLOBAL_ROWS)
        worst = _compare(run, reference)
        print(f"{family}/{attention}: {worst}")
        assert worst["loss"] <= LOSS_TOLERANCE, (run.losses, reference.losses)
        assert worst["grad_norm_rel"] <= NORM_TOLERANCE, (run.grad_norms, reference.grad_norms)
        assert worst["params"] <= PARAM_TOLERANCE, worst
        assert max(reference.grad_norms) > 0.5, "clipping should be active in some step"
        if family == "moe":
            missing_cp = train_reference(family, STEPS, GLOBAL_ROWS, aux_weight=2.0)
            assert _compare(run, missing_cp)["params"] > 20 * PARAM_TOLERANCE, "cannot tell the 1/cp weighting"
    dist.barrier()


@pytest.mark.distributed(world_size=4, timeout=400)
def test_hsdp_dp_replicate2_x_cp2_training_equals_one_process():
    """Replicas over dp_replicate, FSDP over dp_cp_shard = cp: the cp ranks shard the parameters."""
    ctx = DistributedContext.build(MeshDegrees(dp_replicate=2, cp=2), device="cpu")
    run = train_distributed(ctx, "moe", STEPS, GLOBAL_ROWS, "ring", data_parallel=HsdpConfig())
    if ctx.rank == 0:
        worst = _compare(run, train_reference("moe", STEPS, GLOBAL_ROWS))
        print(f"moe/ring dp_replicate=2 x cp=2 (HSDP): {worst}")
        assert worst["loss"] <= LOSS_TOLERANCE and worst["params"] <= PARAM_TOLERANCE, worst
        assert worst["grad_norm_rel"] <= NORM_TOLERANCE, worst
    dist.barrier()


@pytest.mark.distributed(world_size=4, timeout=400)
def test_cp4_training_equals_one_process():
    """Every rank one cp shard (4 micro-batches each): the layout's 8 chunks, the ring's 4 steps."""
    ctx = DistributedContext.build(MeshDegrees(cp=4), device="cpu")
    run = train_distributed(ctx, "dense", STEPS, GLOBAL_ROWS, "ring")
    if ctx.rank == 0:
        worst = _compare(run, train_reference("dense", STEPS, GLOBAL_ROWS))
        print(f"dense/ring cp=4: {worst}")
        assert worst["loss"] <= LOSS_TOLERANCE and worst["params"] <= PARAM_TOLERANCE, worst
        assert worst["grad_norm_rel"] <= NORM_TOLERANCE, worst
    dist.barrier()


@pytest.mark.distributed(world_size=4, timeout=400)
def test_checkpoint_written_under_cp2_dp2_resumes_on_dp4_with_the_same_global_batch(tmp_path):
    first = DistributedContext.build(MeshDegrees(dp_shard=2, cp=2), device="cpu")
    build_cp_trainer(
        first, family="dense", total_steps=STEPS, global_rows=GLOBAL_ROWS, checkpoint_dir=tmp_path, checkpoint_every=5
    ).train()
    dist.barrier()
    if first.rank == 0:  # as if the job had died after step 5's checkpoint (the LR schedule spans all 10 steps)
        shutil.rmtree(tmp_path / f"step-{STEPS:08d}")
    dist.barrier()
    second = DistributedContext.build(MeshDegrees(dp_shard=4), device="cpu")
    resumed = build_cp_trainer(
        second, family="dense", total_steps=STEPS, global_rows=GLOBAL_ROWS, checkpoint_dir=tmp_path
    ).train()
    assert resumed.resumed_from is not None and resumed.resumed_from.name.endswith("5")
    if second.rank == 0:
        reference = train_reference("dense", STEPS, GLOBAL_ROWS)
        worst = max(abs(resumed.losses[step] - reference.losses[step - 1]) for step in range(6, STEPS + 1))
        print(f"resume cp2xdp2 -> dp4: max |loss - reference| over steps 6-10 = {worst:.2e}")
        assert worst <= LOSS_TOLERANCE
    dist.barrier()


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=8, timeout=600)
def test_tp2_cp2_dp2_training_equals_one_process(family):
    """8 ranks: tensor + sequence parallel (tp=2) inside each cp shard, ring attention over cp=2, FSDP over
    dp_cp_shard (dp_shard=2 x cp=2). Same steps, batches and tolerances as the cp2 x dp2 test."""
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, cp=2, tp=2), device="cpu")
    run = train_distributed(ctx, family, STEPS, GLOBAL_ROWS, "ring")
    if ctx.rank == 0:
        worst = _compare(run, train_reference(family, STEPS, GLOBAL_ROWS))
        print(f"{family}/ring tp=2 x cp=2 x dp_shard=2: {worst}")
        assert worst["loss"] <= LOSS_TOLERANCE and worst["params"] <= PARAM_TOLERANCE, worst
        assert worst["grad_norm_rel"] <= NORM_TOLERANCE, worst
    dist.barrier()


@pytest.mark.parametrize(("family", "attention"), [("dense", "ring"), ("moe", "all_gather")])
@pytest.mark.distributed(world_size=4, timeout=400)
def test_cp2_dp2_with_compiled_layers_equals_one_process_and_compiles_once(family, attention):
    """Regional compilation (each decoder layer's forward) under cp=2 x dp_shard=2: the context-parallel attention's
    exchanges (the ring's P2P steps, the all-gather of keys and values) and the layout's derived offsets run inside
    the compiled layers, so they must trace without baking a step's documents into guards. Backend aot_eager, as in
    the EP compiled test (test_expert_parallel.py): Dynamo's capture, guards and graph breaks and AOTAutograd's joint
    graph are what CP can break; Inductor's fusions are the GPU benchmarks' business, and its cold C++ compilation
    costs about a minute per rank on this 2-core machine. Same tolerances as the eager test above: the compiled
    backward may sum a gradient used twice in another order, within float32 rounding. Measured: dense/ring loss 4.3e-7,
    grad norm 8.5e-8 relative, parameters 1.4e-7; moe/all_gather 4.3e-7, 1.6e-7, 1.2e-7. The graph breaks are the
    deliberate ones: the mask's `derived` offsets (one eager call per layer), the ring's `batch_isend_irecv` (Dynamo
    does not compile P2P by default) and the CPU reference grouped matmul (a host loop over the group sizes)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs_per_step: list[int] = []
    events = EventBus()
    events.subscribe(OptimizerStepped, lambda event: graphs_per_step.append(counters["stats"]["unique_graphs"]))
    compiled = EAGER.model_copy(update={"compile_layers": True, "compile_backend": "aot_eager"})
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, cp=2), device="cpu")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        run = train_distributed(ctx, family, STEPS, GLOBAL_ROWS, attention, decoder=compiled, events=events)
    assert all(getattr(layer, "d9d_compiled", False) for layer in run.model.model.layers.values())
    assert graphs_per_step[0] > 0, "nothing was compiled"
    # Every step packs other documents: a guard on them would compile new graphs after the first step.
    assert graphs_per_step == [graphs_per_step[0]] * STEPS, f"graphs compiled by each step's end: {graphs_per_step}"
    if ctx.rank == 0:
        worst = _compare(run, train_reference(family, STEPS, GLOBAL_ROWS))
        print(f"{family}/{attention} compiled: {worst}; graph breaks {dict(counters['graph_break'])}")
        assert worst["loss"] <= LOSS_TOLERANCE, worst
        assert worst["grad_norm_rel"] <= NORM_TOLERANCE, worst
        assert worst["params"] <= PARAM_TOLERANCE, worst
    dist.barrier()
