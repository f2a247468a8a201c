"""What the user (or a leaf package) implements and the loop drives.

The loop imports no leaf package: data-parallel gradient synchronisation, clipping that knows about sharding,
checkpoint loading of source weights and experiment tracking come in through these protocols. Each has a
single-process default in `d9d.core.loop.defaults`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.dist import DistributedContext
from d9d.core.loop.events import EventBus

if TYPE_CHECKING:
    from d9d.core.loop.schedule import StepSchedule

TBatch = TypeVar("TBatch")
TBatch_contra = TypeVar("TBatch_contra", contravariant=True)


class GradientSync(Protocol):
    """Per-step driver of data-parallel gradient reduction (d9d.parallel's `GradientSync` satisfies it)."""

    def begin_step(self, num_microbatches: int) -> None: ...

    def wait(self) -> None: ...


class GradientClipper(Protocol):
    """Clip gradients in place to a total norm; returns the norm before clipping (exact over sharded grads)."""

    def __call__(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor: ...


class ModelLoader(Protocol):
    """Fill a materialised model's weights from somewhere (e.g. d9d-states' `load_model_state` with a mapper)."""

    def __call__(self, model: nn.Module) -> None: ...


class EventSubscriber(Protocol):
    """A part of the model that follows the loop through its events (e.g. d9d-models' MoE bias balancer on
    `ForwardBackwardFinished`); `build_trainer` subscribes it to the trainer's bus."""

    def subscribe(self, events: EventBus) -> None: ...


class AuxLossWeighting(Protocol):
    """Auxiliary losses a model adds to backward by itself (MoE load balancing, router z-loss; d9d-models'
    `AuxLossWeights`). The loop sets the weight before each step to one over the step's micro-batches on all
    data-parallel ranks, so the auxiliary loss that reaches the summed gradients is the micro-batches' mean."""

    def set_weight(self, weight: float) -> None: ...

    def take_weighted_sum(self) -> float:
        """This rank's weighted auxiliary losses since the last call (summed over ranks: the step's value)."""
        ...


@dataclass(kw_only=True)
class BuiltModel:
    """A materialised, parallelised model stage and what the loop drives for it."""

    model: nn.Module
    gradient_sync: GradientSync
    flops_per_token: float | None = None  # forward + backward model FLOPs per token, for MFU
    aux_losses: AuxLossWeighting | None = None
    subscribers: tuple[EventSubscriber, ...] = ()
    # How a step runs over `model` when it is not plain accumulation (a pipeline schedule over this rank's stages);
    # `build_trainer` uses it unless it is given a schedule of its own.
    schedule: StepSchedule | None = None


class ModelProvider(Protocol):
    """Build a stage on meta, parallelise it, materialise it, then load (through `loader`) or initialise it."""

    def __call__(self, ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel: ...


@dataclass(frozen=True, kw_only=True)
class LossResult:
    """`loss_sum` summed over the micro-batch's counted tokens (the loop divides by the global count)."""

    loss_sum: torch.Tensor
    metrics: Mapping[str, float] = field(default_factory=dict)


class TrainTask(Protocol[TBatch_contra]):
    """Batch to model inputs to loss. The loss weight is a token count, known before forward."""

    def count_tokens(self, batch: TBatch_contra) -> int: ...

    def compute_loss(self, model: nn.Module, batch: TBatch_contra) -> LossResult: ...


class ByteCountingTask(TrainTask[TBatch_contra], Protocol[TBatch_contra]):
    """A task that also knows how many bytes of text its counted tokens stand for (for bits per byte)."""

    def count_bytes(self, batch: TBatch_contra) -> int: ...


class DataSource(Protocol[TBatch]):
    """This rank's micro-batches of one step, and the position in the stream.

    The state must describe the *global* position (e.g. global batches consumed), not a rank's, so a checkpoint
    resumes on any data-parallel size.
    """

    def next_step(self) -> list[TBatch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class DataProvider(Protocol[TBatch]):
    def __call__(self, ctx: DistributedContext, microbatches_per_step: int) -> DataSource[TBatch]: ...


class OptimizerProvider(Protocol):
    def __call__(self, model: nn.Module) -> Optimizer: ...


class LRSchedulerProvider(Protocol):
    def __call__(self, optimizer: Optimizer, total_steps: int) -> LRScheduler: ...


class Tracker(Protocol):
    """Experiment tracking (d9d-metrics' trackers satisfy it). `run_id` is checkpointed and handed back through
    `resume`, so a resumed job continues the same run, and every step ends up in its history exactly once."""

    @property
    def run_id(self) -> str: ...

    def resume(self, run_id: str, step: int) -> None:
        """Continue run `run_id` from the checkpoint of `step`: whatever it holds after `step` (logged before a
        crash) is dropped or overwritten, because the loop logs those steps again."""
        ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def checkpointed(self, step: int) -> None:
        """The checkpoint of `step` is complete: history up to `step` can no longer be replayed, make it durable."""
        ...


class Exporter(Protocol):
    """Write a trained model elsewhere (e.g. Hugging Face layout through d9d-states)."""

    def __call__(self, model: nn.Module) -> None: ...


__all__ = [
    "BuiltModel",
    "ByteCountingTask",
    "DataProvider",
    "DataSource",
    "EventSubscriber",
    "Exporter",
    "GradientClipper",
    "GradientSync",
    "LRSchedulerProvider",
    "LossResult",
    "ModelLoader",
    "ModelProvider",
    "OptimizerProvider",
    "Tracker",
    "TrainTask",
]
