"""Single-process defaults for the injected protocols. (No tracker is the tracker default: `tracker=None`;
the trackers, JSON lines included, live in d9d-metrics.)"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


class NoGradientSync:
    """Nothing to reduce: one process, or a model whose parallelisation reduces gradients itself."""

    def begin_step(self, num_microbatches: int) -> None:
        del num_microbatches

    def wait(self) -> None:
        return None


def clip_grad_norm_torch(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, the norm returned as a plain tensor (use d9d.parallel's on hybrid meshes)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
