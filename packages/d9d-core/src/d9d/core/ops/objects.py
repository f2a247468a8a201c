"""Gathers of picklable Python objects that return the gathered list instead of filling one in place."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank receives every rank's `obj`, in group rank order."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Rank `dst` (a global rank) receives every rank's `obj` in group rank order; the others receive `None`."""
    is_destination = dist.get_rank() == dst
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if is_destination else None
    dist.gather_object(obj, object_gather_list=gathered, dst=dst, group=group)
    return gathered
