"""Attention over a context-parallel (sequence-sharded) batch, as an attention backend the blocks can hold.

The Qwen3 plans' `cp` step swaps this into every attention layer. It reads the shared `AttentionMask`: causal
masking is implied by the load-balanced layout, and a packed batch's local document ids are all-gathered once per
forward pass (cached on the mask) so that every block pair masks other documents.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.kernels.attention import AttentionBackend, AttentionMask
from d9d.models.blocks.decoder import DecoderBackbone
from d9d.models.roles import Role
from d9d.parallel import ByRole, select_modules
from d9d.parallel.context import ContextAttention, ContextParallelConfig, build_context_attention


class HoldsAttentionBackend(Protocol):
    """What a module with the attention role offers: its backend may be swapped (`GroupedQueryAttention`)."""

    backend: AttentionBackend


class ContextParallelAttention:
    """`AttentionBackend` for a sequence sharded over `group` (see `d9d.parallel.context`)."""

    def __init__(self, group: dist.ProcessGroup, config: ContextParallelConfig | None = None) -> None:
        self.config = config or ContextParallelConfig()
        self.group = group
        self.name = f"context_parallel_{self.config.attention}"
        self._attend: ContextAttention = build_context_attention(self.config)

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        if not mask.causal:
            raise ValueError(
                f"{self.name} implements causal attention over the load-balanced layout; got a non-causal mask"
            )
        local = mask.document_ids
        documents = None if local is None else mask.derived("cp_documents", lambda: self._gather_documents(local))
        return self._attend(query, key, value, group=self.group, scale=scale, documents=documents)

    def _gather_documents(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `(batch, local)` document ids, stacked in cp-rank order: `(cp, batch, local)`."""
        shards = [torch.empty_like(local) for _ in range(self.group.size())]
        dist.all_gather(shards, local.contiguous(), group=self.group)
        return torch.stack(shards)


def parallelize_context(model: nn.Module, ctx: DistributedContext, config: ContextParallelConfig | None = None) -> None:
    """The `cp` step of a plan: every attention layer (found by role) attends over the sequence sharded on the batch
    domain's `cp` ranks, and every backbone refuses batches without global positions. Nothing to do at `cp=1`.

    Parameters are untouched: FSDP/HSDP shard over `dp_cp_shard`, so their gradients are summed over cp as over dp.
    """
    if ctx.degrees.cp == 1:
        return
    backend = ContextParallelAttention(ctx.mesh_for(MeshDomain.BATCH)["cp"].get_group(), config)
    for _name, attention in select_modules(model, [ByRole(str(Role.ATTENTION))]):
        cast(HoldsAttentionBackend, attention).backend = backend
    for module in model.modules():
        if isinstance(module, DecoderBackbone):
            module.sequence_sharded = True
