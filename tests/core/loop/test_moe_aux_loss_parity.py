"""MoE auxiliary losses under accumulation and data parallelism: 2 micro-batches x 2 gloo ranks (FSDP) equal one
process training on the whole global batch.

Definition (docs/engine.md): a step's auxiliary loss is the mean of its micro-batches' values over all ranks; every
micro-batch routes the same number of tokens, so this is the token-weighted mean. For the router z-loss (a mean over
tokens) it equals the z-loss of one big batch exactly, so that reference is a single forward over all 4 rows. The
load-balancing loss is computed per micro-batch (its routed fractions are not known for the whole batch before
backward), so its reference forwards the same 4 one-row chunks in one process, each weighted 1/4, with one backward.
The logged `aux_loss` (the weighted sum over ranks) equals the reference's auxiliary loss too.
Tolerance 2e-5 per step over 10 AdamW steps: float32 sums in another order (measured below 1e-6). Without the
weighting every micro-batch's auxiliary loss would count fully (4x): that run is checked to differ by far more.
"""

import pytest
import torch
import torch.distributed as dist
from loop_workload import (
    EAGER,
    MOE_HF,
    SEQ,
    VOCAB,
    CausalLMTask,
    data_provider_for,
    lr_provider,
    optimizer_provider,
)

from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import BuiltModel, EventBus, StepFinished, TrainerConfig, build_trainer, synthetic_global_batch
from d9d.models import materialize_
from d9d.models.blocks.moe import aux_loss_weights
from d9d.models.qwen3 import Qwen3MoeForCausalLM, parallelize_qwen3_moe, qwen3_moe_parameters_from_hf
from d9d.parallel import FsdpConfig, clip_grad_norm_

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

TOLERANCE = 2e-5
STEPS = 10
GLOBAL_ROWS = 4  # 2 ranks x 2 micro-batches of 1 row
COEFFICIENTS = {"z_only": {"z_loss_coef": 0.05}, "z_and_balance": {"z_loss_coef": 0.05, "load_balancing_coef": 0.1}}


def _model(coefficients: dict[str, float]) -> Qwen3MoeForCausalLM:
    params = qwen3_moe_parameters_from_hf(MOE_HF).model_copy(update=coefficients)
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(params, config=EAGER)


def _trainer_losses(ctx: DistributedContext, coefficients: dict[str, float]) -> tuple[list[float], list[float]]:
    """Per step: the token loss and the logged auxiliary loss (`aux_loss`)."""

    def provide(ctx: DistributedContext, loader: object) -> BuiltModel:
        model = _model(coefficients)
        sync = parallelize_qwen3_moe(model, ctx, FsdpConfig())
        materialize_(model, ctx.device)
        return BuiltModel(model=model, gradient_sync=sync, aux_losses=aux_loss_weights(model))

    config = TrainerConfig(
        total_steps=STEPS, global_batch_rows=GLOBAL_ROWS, microbatch_rows=1, max_grad_norm=0.5, seed=3
    )
    events = EventBus()
    aux: list[float] = []
    events.subscribe(StepFinished, lambda event: aux.append(event.metrics["aux_loss"]))
    trainer = build_trainer(
        ctx,
        config,
        events=events,
        model_provider=provide,
        task=CausalLMTask(),
        data_provider=data_provider_for(GLOBAL_ROWS, 1),
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        clipper=clip_grad_norm_,
    )
    result = trainer.train()
    return [result.losses[step] for step in range(1, STEPS + 1)], aux


def _reference_losses(coefficients: dict[str, float], *, chunks: int, weight: float) -> tuple[list[float], list[float]]:
    """One process, the whole global batch per step: one backward of the token-weighted CE plus the aux losses of
    `chunks` forward passes, each weighted `weight`. Returns the token losses and the auxiliary losses."""
    model = _model(coefficients)
    seed_everything(3)
    materialize_(model, "cpu")
    weights = aux_loss_weights(model)
    assert weights is not None
    weights.set_weight(weight)
    optimizer = optimizer_provider(model)
    scheduler = lr_provider(optimizer, STEPS)
    losses, aux = [], []
    for step in range(STEPS):
        batch = synthetic_global_batch(
            seed=5, step=step, rows=GLOBAL_ROWS, seq_len=SEQ, vocab_size=VOCAB, ignore_fraction=0.3
        )
        optimizer.zero_grad(set_to_none=True)
        count = (batch.labels != -100).sum()
        loss_sum = sum(
            model(input_ids, labels=labels).losses.sum()
            for input_ids, labels in zip(batch.input_ids.chunk(chunks), batch.labels.chunk(chunks), strict=True)
        )
        loss = loss_sum / count
        aux.append(weights.take_weighted_sum())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, aux


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", sorted(COEFFICIENTS))
@pytest.mark.distributed(world_size=2, timeout=300)
def test_moe_aux_losses_under_accumulation_and_dp_equal_one_big_batch(case):
    coefficients = COEFFICIENTS[case]
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    losses, aux = _trainer_losses(ctx, coefficients)
    if ctx.rank == 0:
        chunks = 1 if case == "z_only" else GLOBAL_ROWS  # z-loss: a true single forward over the whole batch
        reference, reference_aux = _reference_losses(coefficients, chunks=chunks, weight=1.0 / chunks)
        worst = _worst(losses, reference)
        worst_aux = _worst(aux, reference_aux)
        print(f"{case}: max |loss - one-big-batch loss| over {STEPS} steps = {worst:.2e}, aux {worst_aux:.2e}")
        assert worst <= TOLERANCE, (losses, reference)
        assert worst_aux <= TOLERANCE, (aux, reference_aux)  # the logged auxiliary loss is the big batch's too
        assert min(aux) > 0
        unweighted, _ = _reference_losses(coefficients, chunks=GLOBAL_ROWS, weight=1.0)  # each micro-batch fully
        assert _worst(losses, unweighted) > 20 * TOLERANCE, "the test cannot tell weighted from unweighted"
    dist.barrier()
