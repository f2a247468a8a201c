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


def compile_model(model: nn.Module, *, backend: str = "inductor") -> None:
    """Whole-model compilation: replace `model.forward` by its compiled version (idempotent).

    One graph from the embedding to the loss, so Inductor fuses across layer boundaries (the MLP residual and the next
    layer's norm) and the host launches far fewer kernels. Best without FSDP (`kind='single'`): FSDP2's unit hooks are
    skipped by Dynamo and become graph breaks, which leaves per-layer graphs. Do not combine with `compile_layers`.
    """
    if getattr(model, COMPILED_ATTRIBUTE, False):
        return
    model.forward = torch.compile(model.forward, backend=backend)
    setattr(model, COMPILED_ATTRIBUTE, True)
