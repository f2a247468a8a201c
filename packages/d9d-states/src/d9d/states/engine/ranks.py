"""The ranks taking part in a conversion: a process group, or this process alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """`rank` of `size` in `group`; `group=None` with size 1 means a single process without torch.distributed."""

    rank: int
    size: int
    group: dist.ProcessGroup | None

    @classmethod
    def current(cls, group: dist.ProcessGroup | None = None) -> Ranks:
        """The ranks of `group`, else of the default group if one exists, else this process alone."""
        if group is None and not dist.is_initialized():
            return cls(rank=0, size=1, group=None)
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_gather(self, value: Any) -> list[Any]:
        if self.size == 1:
            return [value]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def broadcast_from_first(self, value: Any) -> Any:
        if self.size == 1:
            return value
        box = [value if self.is_first else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return box[0]
