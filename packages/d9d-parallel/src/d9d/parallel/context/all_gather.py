"""All-gather-KV attention: gather every rank's keys and values, attend locally, reduce-scatter their gradients.

One collective per layer and pass instead of `cp - 1` exchanges, at the cost of holding the whole sequence's keys
and values. The local computation is PyTorch's `scaled_dot_product_attention` with a rectangular mask (this
rank's queries at their global positions against every key), so autograd supplies its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional

from d9d.parallel.context.comm import all_gather_sequence, reduce_scatter_sequence
from d9d.parallel.context.layout import global_positions, unshard_sequence


class _GatherSequence(torch.autograd.Function):
    """Forward: the full sequence from every rank's shard. Backward: sum the gradients, keep this rank's shard."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_sequence(shard, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_sequence(grad, ctx.group), None


def gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather of `(batch, local, ...)` shards into `(batch, seq, ...)` in global order."""
    out = _GatherSequence.apply(shard, group)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    scale: float,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `ring_attention` (documents: `(cp, batch, local)`, every rank's shard in rank order)."""
    rank, size = group.rank(), group.size()
    local = q.shape[1]
    full_k, full_v = gather_sequence(k, group), gather_sequence(v, group)
    query_positions = global_positions(rank, size, local, device=q.device)
    key_positions = torch.arange(local * size, device=q.device)
    allowed = (query_positions[:, None] >= key_positions[None, :])[None]
    if documents is not None:
        key_documents = unshard_sequence(list(documents.unbind(0)), dim=1)
        allowed = allowed & (documents[rank][:, :, None] == key_documents[:, None, :])
    groups = q.shape[2] // k.shape[2]
    out = functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        full_k.transpose(1, 2),
        full_v.transpose(1, 2),
        attn_mask=allowed[:, None],
        scale=scale,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2)
