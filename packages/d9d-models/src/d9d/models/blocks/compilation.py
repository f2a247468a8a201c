"""Regional compilation: each decoder layer's `forward` through `torch.compile`, the rest of the model eager.

Compiling the layer's `forward` (not the module) keeps module hooks outside the compiled region, so FSDP2's
per-layer all-gather and reshard hooks run eagerly around it and the parameter names and state dict are unchanged;
every layer of one kind shares one compiled graph (same code, same shapes), so compile time does not grow with
depth.
"""

from __future__ import annotations

import torch
from torch import nn

COMPILED_ATTRIBUTE = "d9d_compiled"


def compile_layer(layer: nn.Module, *, backend: str = "inductor") -> None:
    """Replace `layer.forward` by its compiled version (idempotent)."""
    if getattr(layer, COMPILED_ATTRIBUTE, False):
        return
    layer.forward = torch.compile(layer.forward, backend=backend)
    setattr(layer, COMPILED_ATTRIBUTE, True)
