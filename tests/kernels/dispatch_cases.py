"""Shared routings and the dispatch-then-combine run of the expert-dispatch tests on gloo groups.

The routing: `tokens` tokens of width `hidden`, each sent to `top_k` distinct experts of `num_experts`, with no
token ever sent to the experts in `UNUSED`. Rank `SILENT_RANK` routes nothing (every copy `-1`); every other rank
has one copy dropped upstream (`-1`, as the MoE layer's per-expert capacity drops them). Expert `e` multiplies its
rows by `e + 1`, so a row that reaches the wrong expert changes the output.
"""

import torch

NUM_EXPERTS, HIDDEN = 8, 6
UNUSED = (3, 6)
SILENT_RANK = 1  # routes no copy at all: sends only padding, still receives and computes


def routing(rank: int, seed: int, *, tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` (tokens, HIDDEN), expert `indices` (tokens, top_k) and normalised combine `weights` of one rank."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    used = torch.tensor([e for e in range(NUM_EXPERTS) if e not in UNUSED])
    indices = torch.stack([used[torch.randperm(len(used), generator=generator)[:top_k]] for _ in range(tokens)])
    if rank == SILENT_RANK:
        indices = torch.full_like(indices, -1)
    else:
        indices[2, 1] = -1
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    x = torch.randn(tokens, HIDDEN, generator=generator)
    return x, indices.long(), weights / weights.sum(dim=-1, keepdim=True)


def expert_scale(group_sizes: torch.Tensor, first_local: int, num_rows: int) -> torch.Tensor:
    """(num_rows, 1): `e + 1` for the rows of global expert `e` (padding rows past the groups get the last local
    expert's; they are zeros and never read)."""
    ends = group_sizes.cumsum(0)
    local = torch.searchsorted(ends, torch.arange(num_rows), right=True).clamp(max=group_sizes.numel() - 1)
    return (local + first_local + 1).float()[:, None]


def dispatch_and_combine(dispatcher, x, indices, weights, first_local: int, upstream: torch.Tensor):
    """Dispatch, scale each expert's rows, combine: the output, the dispatched batch, and the gradients of `x` and
    `weights` under the upstream gradient `upstream`."""
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    dispatched = dispatcher.dispatch(x, indices, weights)
    rows = dispatched.rows * expert_scale(dispatched.group_sizes, first_local, dispatched.rows.shape[0])
    out = dispatcher.combine(rows, dispatched)
    grads = torch.autograd.grad((out * upstream).sum(), (x, weights))
    return out.detach(), dispatched, grads
