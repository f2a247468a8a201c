"""Sums over the data-parallel ranks of a step (tokens, losses): the exact token weighting rests on these."""

from __future__ import annotations

import torch
import torch.distributed as dist

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain


def dp_group(ctx: DistributedContext | None) -> dist.ProcessGroup | None:
    """The group of ranks that hold different data (None: single process)."""
    if ctx is None or ctx.world_size == 1:
        return None
    return ctx.mesh_for(MeshDomain.BATCH)["dp"].get_group()


def sum_over(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """Element-wise sums over `group`, in float64 (exact for token counts below 2**53)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return [float(value) for value in tensor.tolist()]
