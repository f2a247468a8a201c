"""Adding a full-size delta into a (possibly sharded) weight in place."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank of its mesh must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def reshard_fsdp_modules(module: nn.Module) -> None:
    """Put every FSDP module of `module` back into its sharded state.

    After a forward with `reshard_after_forward=False` (and always for the root) a module's `weight` is a temporary
    unsharded copy that the next reshard or `state_dict` discards; merging must write into the sharded DTensor."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def fsdp_managed_modules(module: nn.Module) -> set[int]:
    """The ids of the modules of `module` that are, or sit below, an FSDP module (their parameters are sharded)."""
    return {id(inner) for sub in module.modules() if isinstance(sub, FSDPModule) for inner in sub.modules()}


@torch.no_grad()
def add_full_(weight: torch.Tensor, delta: torch.Tensor, *, fsdp_managed: bool = False) -> None:
    """`weight += delta` where `delta` is the whole tensor on every rank and `weight` may be a DTensor shard.

    `fsdp_managed`: the weight's module is sharded by FSDP, so its weight must be the sharded DTensor; a plain
    tensor there is FSDP's temporary unsharded copy, and adding into it would be lost at the next reshard."""
    delta = delta.detach().to(weight.dtype)
    if isinstance(weight, DTensor):
        # Every rank holds the same full delta, so slicing out the shard needs no communication.
        local = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight.to_local().add_(local)
    elif fsdp_managed:
        raise RuntimeError(
            f"cannot merge into a weight of shape {tuple(weight.shape)} of an FSDP-managed module: it is FSDP's "
            "unsharded copy (left by a forward with reshard_after_forward=False), which the next reshard discards; "
            "call reshard() on every FSDPModule first (merge_peft and LoRA.merge do)"
        )
    else:
        weight.add_(delta)
