"""Per-layer activation checkpointing without wrapper modules (parameter names stay unchanged)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT_ATTRIBUTE = "d9d_activation_checkpointing"


def set_activation_checkpointing(layer: nn.Module, enabled: bool = True) -> None:
    """Recompute `layer`'s activations in backward instead of keeping them (when run through `run_layer`)."""
    setattr(layer, CHECKPOINT_ATTRIBUTE, enabled)


def uses_activation_checkpointing(layer: nn.Module) -> bool:
    return bool(getattr(layer, CHECKPOINT_ATTRIBUTE, False))


def run_layer(layer: nn.Module, *args: Any) -> torch.Tensor:
    """`layer(*args)`, checkpointed (non-reentrant) if enabled for it and gradients are being recorded."""
    if uses_activation_checkpointing(layer) and torch.is_grad_enabled():
        out = checkpoint(layer, *args, use_reentrant=False)
    else:
        out = layer(*args)
    assert isinstance(out, torch.Tensor)
    return out
