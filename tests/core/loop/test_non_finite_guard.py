"""The non-finite guard: a NaN loss on one rank alone makes every rank skip the same step (parameters and optimizer
state bitwise unchanged, the skip counted as a metric); the stop policy and the consecutive-skip limit fail with an
error naming the step, on every rank."""

import math

import pytest
import torch
from loop_workload import CausalLMTask, TinyModelProvider, data_provider_for, lr_provider, optimizer_provider

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    EventBus,
    LossResult,
    NonFiniteConfig,
    NonFiniteStepError,
    OptimizerStepped,
    StepFinished,
    StepSkipped,
    StepStarted,
    TrainerConfig,
    build_trainer,
)
from d9d.parallel import clip_grad_norm_


class NanOnRank(CausalLMTask):
    """The real task, except that on `rank` at the given steps its loss is NaN (a bad batch on one rank)."""

    def __init__(self, rank: int, steps: set[int], events: EventBus) -> None:
        self.rank, self.steps, self.step = rank, steps, 0
        events.subscribe(StepStarted, lambda event: setattr(self, "step", event.step))

    def compute_loss(self, model, batch) -> LossResult:
        result = super().compute_loss(model, batch)
        if torch.distributed.get_rank() == self.rank and self.step in self.steps:
            return LossResult(loss_sum=result.loss_sum * math.nan)
        return result


def _trainer(ctx, events, nan_steps, non_finite, total_steps=5):
    config = TrainerConfig(total_steps=total_steps, global_batch_rows=4, microbatch_rows=1, non_finite=non_finite)
    return build_trainer(
        ctx, config, model_provider=TinyModelProvider("dense", "fsdp"), task=NanOnRank(1, nan_steps, events),
        data_provider=data_provider_for(4, 1), optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider, clipper=clip_grad_norm_, events=events,
    )  # fmt: skip


def _local_state(trainer) -> list[torch.Tensor]:
    params = [param.to_local().detach().clone() for param in trainer.parts.model.parameters()]
    moments = [
        value.to_local().detach().clone() if hasattr(value, "to_local") else torch.as_tensor(value).clone()
        for state in trainer.parts.optimizer.state.values()
        for value in state.values()
    ]
    return params + moments


@pytest.mark.distributed(world_size=2, timeout=180)
def test_a_nan_on_one_rank_makes_every_rank_skip_that_step_leaving_the_state_bitwise_unchanged():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    events, snapshots, skipped, stepped, metrics = EventBus(), {}, [], [], {}
    trainer = _trainer(ctx, events, nan_steps={3}, non_finite=NonFiniteConfig(policy="skip", max_consecutive_skips=1))
    events.subscribe(StepStarted, lambda event: snapshots.__setitem__(("before", event.step), _local_state(trainer)))
    events.subscribe(StepSkipped, lambda event: skipped.append(event.step))
    events.subscribe(OptimizerStepped, lambda event: stepped.append(event.step))

    def after(event: StepFinished) -> None:
        snapshots["after", event.step] = _local_state(trainer)
        metrics[event.step] = event.metrics

    events.subscribe(StepFinished, after)
    result = trainer.train()

    assert skipped == [3] and stepped == [1, 2, 4, 5]  # on both ranks, although only rank 1's loss was NaN
    assert math.isnan(result.losses[3]) and all(math.isfinite(result.losses[step]) for step in (1, 2, 4, 5))
    before, after_skip = snapshots["before", 3], snapshots["after", 3]
    assert len(before) == len(after_skip)
    assert all(torch.equal(a, b) for a, b in zip(before, after_skip, strict=True))  # bitwise, optimizer state too
    assert not all(torch.equal(a, b) for a, b in zip(snapshots["before", 4], snapshots["after", 4], strict=True))
    assert [metrics[step]["skipped_steps"] for step in range(1, 6)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert trainer.skipped_steps == 1


@pytest.mark.distributed(world_size=2, timeout=180)
def test_the_stop_policy_fails_every_rank_naming_the_step():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    trainer = _trainer(ctx, EventBus(), nan_steps={2}, non_finite=NonFiniteConfig(policy="stop"))
    with pytest.raises(NonFiniteStepError, match=r"step 2: the loss is nan .*policy='stop'"):
        trainer.train()
    assert trainer.step == 2


@pytest.mark.distributed(world_size=2, timeout=180)
def test_skipping_stops_after_the_configured_number_of_consecutive_non_finite_steps():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    trainer = _trainer(ctx, EventBus(), nan_steps={2, 3, 4}, non_finite=NonFiniteConfig(max_consecutive_skips=2))
    with pytest.raises(NonFiniteStepError, match=r"step 4: .*3 non-finite steps in a row, more than .*=2"):
        trainer.train()
    assert trainer.skipped_steps == 3
