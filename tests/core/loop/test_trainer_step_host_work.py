"""The Trainer's per-step host work: the model's parameters are walked once per run, not per step, and the one
clearing of gradients per step covers every parameter (also those the optimizer does not hold).

The model, task and data here are the tiny Qwen3 of `loop_workload`, but the task finds its device without asking
the model for its parameters, so a spy on `named_parameters` counts only the loop's own walks.
"""

from dataclasses import dataclass, field

import pytest
import torch
from loop_workload import TinyModelProvider
from torch import nn
from torch.optim import Optimizer

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    BuiltModel,
    EventBus,
    ForwardBackwardFinished,
    LossResult,
    ModelLoader,
    TokenBatch,
    TrainerConfig,
    build_trainer,
    synthetic_global_batch,
)
from d9d.core.lr import ConstantScheduleConfig, build_lr_scheduler
from d9d.parallel import clip_grad_norm_


class CpuCausalLMTask:
    def count_tokens(self, batch: TokenBatch) -> int:
        return int((batch.labels != -100).sum())

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        return LossResult(loss_sum=model(batch.input_ids, labels=batch.labels).losses.sum())


@dataclass
class SameBatchEveryStep:
    """One fixed global batch at every step: with a model that does not move, every step's gradients are equal."""

    batch: TokenBatch = field(
        default_factory=lambda: synthetic_global_batch(seed=1, step=0, rows=2, seq_len=12, vocab_size=96)
    )

    def next_step(self) -> list[TokenBatch]:
        return [self.batch]

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: object) -> None:
        del state


@pytest.mark.distributed(world_size=1, timeout=120)
def test_one_parameter_walk_per_run_and_gradients_cleared_outside_the_optimizer_too():
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    walks = []

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        built = TinyModelProvider("dense", "none")(ctx, loader)  # NoGradientSync: the loop alone clears gradients
        model = built.model
        walk = model.named_parameters
        model.named_parameters = lambda *args, **kwargs: walks.append(1) or walk(*args, **kwargs)  # a spy
        return built

    def optimizer_provider(model: nn.Module) -> Optimizer:
        # lr 0: the model never moves; and the optimizer holds only the first layer
        return torch.optim.SGD(model.get_submodule("model.layers.0").parameters(), lr=0.0)

    grads_by_step: list[dict[str, torch.Tensor]] = []
    events = EventBus()

    def record(event: ForwardBackwardFinished) -> None:
        named = dict(walk_free_named(trainer.parts.model))
        grads_by_step.append({name: param.grad.clone() for name, param in named.items() if param.grad is not None})

    events.subscribe(ForwardBackwardFinished, record)
    config = TrainerConfig(total_steps=3, global_batch_rows=2, microbatch_rows=2, max_grad_norm=None)
    trainer = build_trainer(
        ctx, config, model_provider=model_provider, task=CpuCausalLMTask(),
        data_provider=lambda ctx, microbatches: SameBatchEveryStep(), optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lambda optimizer, steps: build_lr_scheduler(ConstantScheduleConfig(), optimizer, steps),
        clipper=clip_grad_norm_, events=events,
    )  # fmt: skip
    walks.clear()  # building the optimizer walked the first layer
    trainer.train()
    assert len(walks) == 1, f"the loop walked the model's parameters {len(walks)} times in 3 steps"
    first, last = grads_by_step[0], grads_by_step[-1]
    assert len(grads_by_step) == 3 and first.keys() == last.keys()
    assert any(not name.startswith("model.layers.0.") for name in first)  # parameters outside the optimizer
    for name, grad in first.items():
        torch.testing.assert_close(last[name], grad, rtol=0, atol=0, msg=name)  # not accumulated over steps


def walk_free_named(model: nn.Module):
    """`named_parameters` without going through the (spied) method: the test's own reads are not the loop's."""
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield f"{module_name}.{name}" if module_name else name, param
