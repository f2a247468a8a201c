"""`ContextParallelConfig`: which attention variant runs over the sharded sequence."""

from __future__ import annotations

from typing import Literal, Protocol, assert_never

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from d9d.parallel.context.all_gather import all_gather_attention
from d9d.parallel.context.ring import ring_attention


class ContextAttention(Protocol):
    """Causal attention of this rank's shard against the whole (load-balanced) sequence; see `ring_attention`."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        group: dist.ProcessGroup,
        scale: float,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class ContextParallelConfig(BaseModel):
    """`ring`: key/value blocks passed around the cp ranks (memory of one block). `all_gather`: every rank gathers
    all keys/values once per layer (one collective, `cp` times the key/value memory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: Literal["ring", "all_gather"] = "ring"


def build_context_attention(config: ContextParallelConfig) -> ContextAttention:
    match config.attention:
        case "ring":
            return ring_attention
        case "all_gather":
            return all_gather_attention
        case _:
            assert_never(config.attention)
