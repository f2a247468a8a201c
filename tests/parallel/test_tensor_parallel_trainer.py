"""The Trainer under tp=2 x dp_shard=2 (4 gloo ranks) equals single-process whole-batch training, dense and MoE.

Global batch: 8 rows of 12 tokens, ~30% of labels ignored, micro-batches of 1 row: each dp rank accumulates 4
micro-batches per step; the 2 tp ranks of a dp rank see the same rows. 12 AdamW steps with clipping at 0.5 (so the
exact gradient norm over the tp x dp mesh changes the update). float32 throughout: the runs differ only in summation
order (vocabulary-parallel log-sum-exp, reduce-scatters over tp and dp, per-rank loss sums), a few ulps per op that
AdamW's normalisation amplifies over the steps. Measured worst cases (printed): loss 6e-7, grad norm 1e-7 relative,
parameters 1.1e-6; the tolerances leave more than a decade: 2e-5 on loss, 1e-5 relative on the norm, 2e-5 on params.

The tests also pin what tensor parallelism is for: each tensor-parallel parameter's local shard holds 1/tp of it
(before FSDP's split over dp), and no rank ever produces a tensor whose last dimension is the full vocabulary.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "loop"))  # the Trainer workload of the loop tests
from loop_workload import (
    BIAS_RATE,
    SEQ,
    VOCAB,
    build_tiny,
    build_tiny_trainer,
    lr_provider,
    optimizer_provider,
)

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import EventBus, ForwardBackwardFinished, OptimizerStepped
from d9d.models import materialize_
from d9d.models.blocks.moe import MoeBiasBalancer

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

STEPS = 12
LOSS_TOLERANCE = 2e-5
NORM_RELATIVE_TOLERANCE = 1e-5
PARAM_TOLERANCE = 2e-5


def _reference(family: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Single process, the whole global batch at once (no accumulation), torch's own clipping."""
    from d9d.core.determinism import seed_everything
    from d9d.core.loop import synthetic_global_batch

    model = build_tiny(family)
    seed_everything(3)
    materialize_(model, "cpu")
    optimizer = optimizer_provider(model)
    scheduler = lr_provider(optimizer, STEPS)
    balancer = MoeBiasBalancer(model, BIAS_RATE) if family == "moe_bias" else None
    losses, norms = [], []
    for step in range(STEPS):
        batch = synthetic_global_batch(seed=5, step=step, rows=8, seq_len=SEQ, vocab_size=VOCAB, ignore_fraction=0.3)
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch.input_ids, labels=batch.labels).losses.sum() / (batch.labels != -100).sum()
        loss.backward()
        if balancer is not None:
            balancer.balance(ForwardBackwardFinished(step=step + 1, num_microbatches=1))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, norms, {name: param.detach().clone() for name, param in model.named_parameters()}


class _LastDimRecorder(TorchDispatchMode):
    """Records the largest last dimension of any tensor an op produces on this rank (local shards of DTensors)."""

    def __init__(self, watched: int) -> None:
        super().__init__()
        self.watched, self.seen = watched, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.ndim >= 2 and tensor.shape[-1] == self.watched:
                self.seen += 1
        return out


def _check(family: str, degrees: MeshDegrees, parallel: str) -> None:
    ctx = DistributedContext.build(degrees, device="cpu")
    norms: list[float] = []
    events = EventBus()
    events.subscribe(OptimizerStepped, lambda event: norms.append(event.grad_norm))
    trainer = build_tiny_trainer(ctx, family=family, parallel=parallel, total_steps=STEPS, events=events)
    recorder = _LastDimRecorder(VOCAB)
    with recorder:
        result = trainer.train()
    # No full-vocabulary rows anywhere: logits, softmax and their gradients are (tokens, vocab / tp) on each rank.
    assert recorder.seen == 0, f"rank {ctx.rank} produced {recorder.seen} tensors with a full-vocabulary last dim"

    model = trainer.parts.model
    if family == "moe_bias":
        biases = torch.cat([m.expert_bias for m in model.modules() if hasattr(m, "expert_bias")])
        assert biases.abs().sum() > 0
        gathered = [torch.empty_like(biases) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, biases)
        assert all(torch.equal(other, biases) for other in gathered)
    tp_mesh = ctx.mesh_for("dense")["tp"]
    split = 0
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        tp_dim = param.device_mesh.mesh_dim_names.index("tp") if "tp" in param.device_mesh.mesh_dim_names else None
        if tp_dim is not None and isinstance(param.placements[tp_dim], Shard):
            shard_dim = param.placements[tp_dim].dim
            # the tp split alone: redistribute the dp dimension to Replicate and look at the local piece
            placements = [p if i == tp_dim else Replicate() for i, p in enumerate(param.placements)]
            tp_local = param.redistribute(placements=placements).to_local()
            assert tp_local.shape[shard_dim] * tp_mesh.size() == param.shape[shard_dim], name
            assert tp_local.numel() * tp_mesh.size() == param.numel(), name
            split += 1
    assert split > 0

    full_params = {name: param.full_tensor() for name, param in model.named_parameters()}
    if ctx.rank == 0:
        ref_losses, ref_norms, ref_params = _reference(family)
        losses = [result.losses[step] for step in range(1, STEPS + 1)]
        loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        norm_gap = max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True))
        param_gap = max(float((full_params[name] - ref).abs().max()) for name, ref in ref_params.items())
        shown = f"{family} {degrees.describe()} {parallel}"
        print(f"{shown}: loss {loss_gap:.2e}, grad norm (rel.) {norm_gap:.2e}, params {param_gap:.2e}")
        assert loss_gap <= LOSS_TOLERANCE, (losses, ref_losses)
        assert norm_gap <= NORM_RELATIVE_TOLERANCE, (norms, ref_norms)
        assert param_gap <= PARAM_TOLERANCE
    dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dense", "moe", "moe_bias"])
@pytest.mark.distributed(world_size=4, timeout=600)
def test_tp2_dp2_trainer_matches_single_process_whole_batch(family):
    """`moe_bias`: sigmoid routing whose balancing bias moves every step from the expert loads; each tp rank routes
    its sequence shard, so loads are summed over tp as well, and the biases stay identical on every rank."""
    _check(family, MeshDegrees(dp_shard=2, tp=2), "fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=4, timeout=600)
def test_hsdp_with_tp_trainer_matches_single_process_whole_batch(family):
    """dp_replicate=2 x tp=2 under HSDP (shard size 1): the replicate dimension composes with tp as well."""
    _check(family, MeshDegrees(dp_replicate=2, tp=2), "hsdp")


@pytest.mark.slow
@pytest.mark.distributed(world_size=4, timeout=600)
def test_moe_z_loss_under_tp_equals_one_big_batch():
    """Each tp rank's router z-loss is the mean over its sequence shard and counts for 1/tp: their sum is the z-loss
    of the whole micro-batch, so tp2 x dp_shard2 equals one process on the whole batch (the setup and tolerance of
    tests/core/loop/test_moe_aux_loss_parity.py), and the logged auxiliary loss sums the tp shards' parts."""
    from test_moe_aux_loss_parity import COEFFICIENTS, TOLERANCE, _reference_losses, _trainer_losses, _worst

    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, tp=2), device="cpu")
    losses, aux = _trainer_losses(ctx, COEFFICIENTS["z_only"])
    if ctx.rank == 0:
        reference, reference_aux = _reference_losses(COEFFICIENTS["z_only"], chunks=1, weight=1.0)
        print(f"z-loss under tp: loss {_worst(losses, reference):.2e}, aux {_worst(aux, reference_aux):.2e}")
        assert _worst(losses, reference) <= TOLERANCE, (losses, reference)
        assert _worst(aux, reference_aux) <= TOLERANCE, (aux, reference_aux)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.distributed(world_size=8, timeout=900)
def test_dp_replicate_x_dp_shard_x_tp_on_8_ranks_matches_single_process():
    """The full dense mesh, dp_replicate=2 x dp_shard=2 x tp=2 under HSDP: 8 rows, one per data rank and step."""
    _check("dense", MeshDegrees(dp_replicate=2, dp_shard=2, tp=2), "hsdp")
