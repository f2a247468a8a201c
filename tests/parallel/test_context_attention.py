"""Ring and all-gather-KV attention over the load-balanced layout equal full causal attention, forward and backward.

Every rank builds the same global q/k/v (and document ids), keeps its shard, runs the context-parallel attention and
a backward of a fixed random output gradient; its output and q/k/v gradient shards must equal the same shards of
full attention computed in one process by autograd. Tolerance 2e-5 (float32): the online-softmax merge and the
per-block gradient sums add in another order than one softmax (measured ~1e-6).
"""

import pytest
import torch
import torch.distributed as dist

from d9d.parallel.context import (
    BlockMask,
    all_gather_attention,
    eager_block_backward,
    eager_block_forward,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

TOLERANCE = 2e-5
BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 8
VARIANTS = {"ring": ring_attention, "all_gather": all_gather_attention}


def _documents(seq: int, generator: torch.Generator) -> torch.Tensor:
    """Contiguous runs of random lengths (1 to seq/2) per row, so documents cross chunk and rank boundaries."""
    rows = []
    for _ in range(BATCH):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, seq // 2 + 1, (1,), generator=generator)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
        rows.append(ids)
    return torch.stack(rows)


def reference_attention(q, k, v, documents, scale):
    """Full causal (and document) attention with autograd, float32, grouped heads expanded."""
    seq = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


def _check(variant: str, packed: bool, seq: int) -> None:
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(BATCH, seq, HEADS, DIM, generator=generator)
    k = torch.randn(BATCH, seq, KV_HEADS, DIM, generator=generator)
    v = torch.randn(BATCH, seq, KV_HEADS, DIM, generator=generator)
    grad = torch.randn(BATCH, seq, HEADS, DIM, generator=generator)
    documents = _documents(seq, generator) if packed else None
    scale = DIM**-0.5

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, documents, scale)
    expected.backward(grad)

    local = [shard_sequence(t, rank, cp).clone().requires_grad_() for t in (q, k, v)]
    shards = None if documents is None else torch.stack([shard_sequence(documents, r, cp) for r in range(cp)])
    out = VARIANTS[variant](*local, group=group, scale=scale, documents=shards)
    out.backward(shard_sequence(grad, rank, cp))

    worst = {"out": (out - shard_sequence(expected, rank, cp)).abs().max().item()}
    for name, mine, theirs in zip("qkv", local, full, strict=True):
        worst[f"d{name}"] = (mine.grad - shard_sequence(theirs.grad, rank, cp)).abs().max().item()
    assert max(worst.values()) <= TOLERANCE, worst


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.distributed(timeout=120)
def test_context_attention_equals_full_attention(world_size, variant, packed):
    _check(variant, packed, seq=8 * world_size)


@pytest.mark.distributed(world_size=1, timeout=60)
def test_context_attention_on_one_rank_is_plain_causal_attention():
    _check("ring", True, seq=12)


def test_layout_round_trip_and_balance():
    seq, cp = 16, 4
    x = torch.arange(seq)[None]
    shards = [shard_sequence(x, r, cp) for r in range(cp)]
    assert shards[0].tolist() == [[0, 1, 14, 15]]
    assert torch.equal(unshard_sequence(shards), x)
    # Causal (query, key) pairs per rank are equal: the point of the layout.
    work = [int((s[0] + 1).sum()) for s in shards]
    assert len(set(work)) == 1, work


def test_eager_block_kernel_gradients_match_autograd():
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 4, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 6, 2, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 6, 2, 8, generator=generator, dtype=torch.float64)
    grad = torch.randn(2, 6, 4, 8, generator=generator, dtype=torch.float64)
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    mask = BlockMask(causal=True, allowed=documents[:, :, None] == documents[:, None, :])
    out, lse = eager_block_forward(q, k, v, scale=0.3, mask=mask)
    dq, dk, dv = eager_block_backward(grad.float(), q, k, v, out=out, lse=lse, scale=0.3, mask=mask)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, documents, 0.3)
    expected.backward(grad)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    for mine, theirs in zip((dq, dk, dv), full, strict=True):
        assert torch.allclose(mine.double(), theirs.grad, atol=1e-5)
