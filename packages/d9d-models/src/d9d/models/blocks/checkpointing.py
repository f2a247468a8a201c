"""Per-layer activation checkpointing without wrapper modules (parameter names stay unchanged).

Policies: `full` keeps only the layer's inputs and recomputes the whole layer in backward; `selective` keeps the
outputs of the expensive ops (matmuls, grouped matmuls, attention kernels) and recomputes only the cheap ones
between them (norms, activations, RoPE, permutations), trading a little memory for most of the recompute time.
"""

from __future__ import annotations

import enum
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy as OpPolicy
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

CHECKPOINT_ATTRIBUTE = "d9d_activation_checkpointing"


class CheckpointPolicy(enum.StrEnum):
    FULL = "full"
    SELECTIVE = "selective"


def set_activation_checkpointing(layer: nn.Module, enabled: bool | CheckpointPolicy = True) -> None:
    """Recompute `layer`'s activations in backward instead of keeping them (when run through `run_layer`); `True`
    means the `full` policy."""
    policy = CheckpointPolicy.FULL if enabled is True else (enabled or None)
    setattr(layer, CHECKPOINT_ATTRIBUTE, policy)


def checkpoint_policy(layer: nn.Module) -> CheckpointPolicy | None:
    value = getattr(layer, CHECKPOINT_ATTRIBUTE, None)
    return CheckpointPolicy.FULL if value is True else (value or None)


def uses_activation_checkpointing(layer: nn.Module) -> bool:
    return checkpoint_policy(layer) is not None


def _saved_ops() -> set[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention (those that exist here)."""
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ]  # fmt: skip
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    # The Triton grouped GEMM and FlashAttention, when their packages registered them.
    for namespace, name in (("d9d_kernels", "grouped_mm_forward"), ("flash_attn", "_flash_attn_forward")):
        packet = getattr(getattr(torch.ops, namespace), name, None) if hasattr(torch.ops, namespace) else None
        if packet is not None:
            ops.add(packet.default)
    return ops


def _selective_policy(saved: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> OpPolicy:
    del ctx, args, kwargs
    return OpPolicy.MUST_SAVE if op in saved else OpPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(partial(_selective_policy, _saved_ops()))  # type: ignore[no-untyped-call]


def run_layer(layer: nn.Module, *args: Any) -> torch.Tensor:
    """`layer(*args)`, checkpointed (non-reentrant) with its policy if one is set and gradients are being recorded."""
    policy = checkpoint_policy(layer)
    if policy is not None and torch.is_grad_enabled():
        if policy == CheckpointPolicy.SELECTIVE:
            out = checkpoint(layer, *args, use_reentrant=False, context_fn=_selective_contexts)
        else:
            out = checkpoint(layer, *args, use_reentrant=False)
    else:
        out = layer(*args)
    assert isinstance(out, torch.Tensor)
    return out
