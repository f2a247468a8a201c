"""Adding a full-size delta into a (possibly sharded) weight in place."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank of its mesh must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def add_full_(weight: torch.Tensor, delta: torch.Tensor) -> None:
    """`weight += delta` where `delta` is the whole tensor on every rank and `weight` may be a DTensor shard."""
    delta = delta.detach().to(weight.dtype)
    if isinstance(weight, DTensor):
        # Every rank holds the same full delta, so slicing out the shard needs no communication.
        local = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight.to_local().add_(local)
    else:
        weight.add_(delta)
