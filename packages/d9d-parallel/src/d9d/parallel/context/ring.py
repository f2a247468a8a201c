"""Ring attention over the load-balanced layout: key/value blocks travel around the context-parallel ranks.

Step `s` of `cp`, rank `r` holds the keys/values of rank `src = r - s` and attends its queries to them, merging
with the log-sum-exp. With the load-balanced layout (see `layout`) each block pair is one of three cases:

| block from | queries | keys | mask |
|---|---|---|---|
| itself (`src == r`) | both chunks | both chunks | causal |
| a lower rank (`src < r`) | both chunks | its head chunk | none |
| a higher rank (`src > r`) | the tail chunk | both chunks | none |

so every rank does the same work at every step. With packed documents, keys of another document are masked too
(`documents`). Backward runs the ring again: the key/value gradients travel beside their block and reach the
owner after the last step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from d9d.parallel.context.blocks import BlockMask, block_backward, block_forward, merge_into
from d9d.parallel.context.comm import RingExchange, finish


def block_pair(rank: int, src: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query slice, key slice, causal) of the local queries against the keys/values that came from `src`."""
    half = local_len // 2
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _mask(documents: torch.Tensor | None, *, rank: int, src: int, query: slice, key: slice, causal: bool) -> BlockMask:
    if documents is None:
        return BlockMask(causal=causal)
    same = documents[rank][:, query, None] == documents[src][:, None, key]
    return BlockMask(causal=causal, allowed=same)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 - autograd.Function.apply passes positional arguments only
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        scale: float,
        documents: torch.Tensor | None,
    ) -> torch.Tensor:
        rank, size = group.rank(), group.size()
        ring = RingExchange(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        flash_aux = None
        for step in range(size):
            pending = ring.start(kv) if step < size - 1 else None  # the next block moves while this one computes
            src = (rank - step) % size
            query, key, causal = block_pair(rank, src, q.shape[1])
            mask = _mask(documents, rank=rank, src=src, query=query, key=key, causal=causal)
            block_out, block_lse, aux = block_forward(q[:, query], kv[0][:, key], kv[1][:, key], scale=scale, mask=mask)
            flash_aux = flash_aux or aux
            out[:, query], lse[:, query] = merge_into(out[:, query], lse[:, query], block_out, block_lse)
            if pending is not None:
                finish(pending[1])
                kv = pending[0]
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.group, ctx.scale, ctx.flash_aux = group, scale, flash_aux
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, documents = ctx.saved_tensors
        group: dist.ProcessGroup = ctx.group
        rank, size = group.rank(), group.size()
        ring = RingExchange(group)
        grad_out = grad_out.float()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(size):
            pending = ring.start(kv) if step < size - 1 else None
            src = (rank - step) % size
            query, key, causal = block_pair(rank, src, q.shape[1])
            dq, dk, dv = block_backward(
                grad_out[:, query],
                q[:, query],
                kv[0][:, key],
                kv[1][:, key],
                out=out[:, query],
                lse=lse[:, query],
                scale=ctx.scale,
                mask=_mask(documents, rank=rank, src=src, query=query, key=key, causal=causal),
                flash_aux=ctx.flash_aux,
            )
            grad_q[:, query] += dq
            grad_kv[0][:, key] += dk
            grad_kv[1][:, key] += dv
            if size > 1:  # hand the accumulated gradient on; after the last step it arrives at its owner
                received, requests = ring.start(grad_kv)
                finish(requests)
                grad_kv = received
            if pending is not None:
                finish(pending[1])
                kv = pending[0]
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    scale: float,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's shard of the load-balanced layout against the whole sequence.

    `q` `(batch, local, H, D)`, `k`/`v` `(batch, local, H_kv, D)`: this rank's shards. `documents`, when packed,
    is every rank's shard of the document ids in rank order, `(cp, batch, local)` (see `all_gather_shards`).
    Returns `(batch, local, H, D)` in `q`'s dtype.
    """
    out = _RingAttention.apply(q, k, v, group, scale, documents)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
