"""Typed events around the phases of a step, and a synchronous, fail-fast event bus.

A subscriber names the context type it wants (`bus.subscribe(StepFinished, callback)`) and receives exactly that
frozen dataclass, so it sees what it may use and nothing else.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

TEvent = TypeVar("TEvent")


@dataclass(frozen=True, kw_only=True)
class TrainingStarted:
    start_step: int
    total_steps: int
    resumed_from: Path | None


@dataclass(frozen=True, kw_only=True)
class StepStarted:
    step: int


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardFinished:
    """After every micro-batch of the step went through forward and backward and the gradients are synchronised,
    before clipping and the optimizer step.

    A subscriber that keeps state in step across data-parallel ranks (e.g. d9d-models' MoE bias balancer) reduces
    over `data_parallel_group` (the data- and context-parallel ranks; None: a single process) on `device`, and may
    add what it measured to `metrics`: the loop logs them with the step's own metrics.
    """

    step: int
    num_microbatches: int
    data_parallel_group: Any = None  # torch.distributed.ProcessGroup | None (kept untyped: no torch import here)
    device: Any = None  # torch.device
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class OptimizerStepped:
    step: int
    grad_norm: float
    learning_rate: float


@dataclass(frozen=True, kw_only=True)
class StepSkipped:
    """The step's loss or gradient norm was not finite: every rank left the parameters, optimizer state and LR
    schedule as they were (emitted instead of `OptimizerStepped`)."""

    step: int
    loss: float
    grad_norm: float
    consecutive: int


@dataclass(frozen=True, kw_only=True)
class StepFinished:
    """A finished step with its logged metrics (`loss` is the exact token-weighted mean of the global batch)."""

    step: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ValidationFinished:
    step: int
    loss: float
    perplexity: float
    tokens: int


@dataclass(frozen=True, kw_only=True)
class CheckpointStarted:
    step: int
    path: Path


@dataclass(frozen=True, kw_only=True)
class CheckpointWritten:
    """The checkpoint's data is on disk, its completion marker not yet: a crash now leaves it incomplete."""

    step: int
    path: Path


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved:
    step: int
    path: Path


@dataclass(frozen=True, kw_only=True)
class TrainingFinished:
    step: int
    preempted: bool


class EventBus:
    """Maps an event context type to its subscribers; `emit` calls them in subscription order, exceptions propagate."""

    def __init__(self) -> None:
        self._subscribers: defaultdict[type[Any], list[Callable[[Any], None]]] = defaultdict(list)

    def subscribe(self, event_type: type[TEvent], callback: Callable[[TEvent], None]) -> None:
        self._subscribers[event_type].append(callback)

    def emit(self, event: object) -> None:
        for callback in self._subscribers.get(type(event), ()):
            callback(event)
