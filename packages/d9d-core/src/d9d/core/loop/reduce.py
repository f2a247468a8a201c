"""Sums over the data-parallel ranks of a step (tokens, losses): the exact token weighting rests on these."""

from __future__ import annotations

import torch
import torch.distributed as dist

from d9d.core.dist import DistributedContext, moves_cpu_tensors
from d9d.core.dist.domains import MeshDomain


def dp_group(ctx: DistributedContext | None) -> dist.ProcessGroup | None:
    """The group of ranks that hold different data (None: single process)."""
    if ctx is None or ctx.world_size == 1:
        return None
    return ctx.mesh_for(MeshDomain.BATCH)["dp"].get_group()


def token_group(ctx: DistributedContext | None) -> dist.ProcessGroup | None:
    """The group of ranks that hold different *tokens*: the data-parallel ranks times the context-parallel ranks
    (each cp rank holds a shard of its data-parallel rank's sequences). Sum token counts and losses over this group;
    split rows over `dp_group` (None: single process)."""
    if ctx is None or ctx.world_size == 1:
        return None
    mesh = ctx.mesh_for(MeshDomain.BATCH)
    if ctx.degrees.cp == 1:
        return mesh["dp"].get_group()
    if ctx.degrees.dp == 1:
        return mesh["cp"].get_group()
    return mesh["dp", "cp"]._flatten("dp_cp").get_group()  # torch caches it: one group however often asked


def sum_over(values: list[float], group: dist.ProcessGroup | None, device: torch.device | None = None) -> list[float]:
    """Element-wise sums over `group`, in float64 (exact for token counts below 2**53).

    Host numbers go through a CPU tensor when `group` moves CPU tensors (gloo, or the `cpu:gloo,cuda:nccl` pair the
    context initialises on GPUs, which its meshes' groups inherit), else through one on `device` (a plain NCCL
    group). On the host, the sum never waits for the device: at the start of a step a device round trip would wait
    for the previous step's optimizer kernels, and the host could not queue the next forward behind them.
    """
    if group is None:
        # One process: the sums are the values, no collective at all.
        return [float(value) for value in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=None if moves_cpu_tensors(group) else device)
    dist.all_reduce(tensor, group=group)
    return [float(value) for value in tensor.tolist()]


def sum_tensors_over(
    tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Sums of same-named 1-D tensors over `group`, in one all-reduce (names sorted so every rank agrees)."""
    names = sorted(tensors)
    if not names:
        return {}
    flat = torch.cat([tensors[name].detach().float().reshape(-1).to(device) for name in names])
    if group is not None:
        dist.all_reduce(flat, group=group)
    sizes = [tensors[name].numel() for name in names]
    return dict(zip(names, torch.split(flat, sizes), strict=True))
