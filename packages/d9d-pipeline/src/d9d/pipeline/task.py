"""What a training task implements to run pipelined: the forward of one stage on one micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from d9d.core.loop.protocols import LossResult
from d9d.pipeline.stage import PipelineStage

TBatch_contra = TypeVar("TBatch_contra", contravariant=True)


@dataclass(frozen=True)
class ActivationSpec:
    """Shape and dtype of the tensor one stage hands the next (receive buffers are allocated from it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@runtime_checkable
class PipelineTask(Protocol[TBatch_contra]):
    """A `TrainTask` that can also run stage by stage.

    `forward_stage` returns the activation for the next stage on every stage but the last, and the micro-batch's
    `LossResult` (summed loss over its counted tokens, metrics) on the last. `activation_spec` says what a stage
    hands the next for a micro-batch, from the batch alone (stage metadata: the executor never traces).
    """

    def count_tokens(self, batch: TBatch_contra) -> int: ...

    def forward_stage(
        self, module: nn.Module, batch: TBatch_contra, *, stage: PipelineStage, hidden: torch.Tensor | None
    ) -> torch.Tensor | LossResult: ...

    def activation_spec(self, batch: TBatch_contra, *, stage: PipelineStage) -> ActivationSpec: ...
