"""Fused linear + cross-entropy: eager-chunked and Triton backends against the full-logits reference, the split
backward halves, and the per-shard pieces a vocabulary-parallel head composes (two shards in one process)."""

import contextlib

import pytest
import torch
from triton_cases import DEVICE, DTYPES, HAS_TRITON, close, randn, requires_triton

from d9d.kernels import BackendUnavailable
from d9d.kernels.linear_cross_entropy import (
    IGNORE_INDEX,
    EagerLinearCrossEntropy,
    TorchChunkMath,
    TritonLinearCrossEntropy,
    combine_logit_stats,
    linear_cross_entropy_reference,
    logit_gradients,
    logit_stats,
    losses_from_stats,
)

TOKENS, HIDDEN, VOCAB, CHUNK = 13, 16, 100, 4  # 4 chunks, the last one short; vocab not a power of two


def _inputs(dtype):
    hidden = randn(TOKENS, HIDDEN, seed=0, dtype=dtype)
    weight = randn(VOCAB, HIDDEN, seed=1, dtype=dtype, scale=0.5)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(2)).to(hidden.device)
    labels[[1, 7]] = IGNORE_INDEX
    return hidden, weight, labels


def _run(fn, dtype):
    hidden, weight, labels = _inputs(dtype)
    hidden.requires_grad_(), weight.requires_grad_()
    losses = fn(hidden, weight, labels)
    losses.backward(randn(TOKENS, seed=3))
    return losses, hidden.grad, weight.grad


def _backends():
    backends = [EagerLinearCrossEntropy()]
    with contextlib.suppress(BackendUnavailable):  # triton missing: only the eager backend runs here
        backends.append(TritonLinearCrossEntropy())
    return backends


@DTYPES
@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_backend_matches_full_logits_reference(backend, dtype):
    got = _run(lambda h, w, y: backend(h, w, y, chunk_size=CHUNK), dtype)
    want = _run(linear_cross_entropy_reference, dtype)
    assert got[0].dtype == torch.float32 and got[1].dtype == dtype and got[2].dtype == dtype
    assert torch.all(got[0][[1, 7]] == 0)  # ignored tokens: no loss ...
    # fp32: same float32 softmax, different summation order. bf16: the reference's autograd rounds the logits'
    # gradient to bf16 once per element just like the chunked paths; the hidden/weight gradients are bf16 matmuls.
    close(got[0], want[0], dtype, bf16=1e-2, msg="losses")
    close(got[1], want[1], dtype, bf16=3e-2, msg="grad hidden")
    close(got[2], want[2], dtype, bf16=3e-2, msg="grad weight")


@requires_triton
def test_split_backward_halves_equal_the_fused_backward_and_ops_pass_opcheck():
    from d9d.kernels.linear_cross_entropy import ops

    hidden, weight, labels = _inputs(torch.float32)
    stats = ops.shard_logit_stats(hidden, weight, labels, chunk_size=CHUNK)
    lse, grad = stats.logsumexp(), randn(TOKENS, seed=3)
    both = torch.ops.d9d_kernels.linear_cross_entropy_backward(hidden, weight, labels, lse, grad, 0, CHUNK)
    grad_hidden = ops.linear_cross_entropy_backward_input(hidden, weight, labels, lse, grad, chunk_size=CHUNK)
    grad_weight = ops.linear_cross_entropy_backward_weight(hidden, weight, labels, lse, grad, chunk_size=CHUNK)
    torch.testing.assert_close(grad_hidden, both[0], atol=0, rtol=0)
    torch.testing.assert_close(grad_weight, both[1], atol=0, rtol=0)
    torch.library.opcheck(torch.ops.d9d_kernels.linear_cross_entropy_stats, (hidden, weight, labels, 0, CHUNK))
    for op in (
        torch.ops.d9d_kernels.linear_cross_entropy_backward,
        torch.ops.d9d_kernels.linear_cross_entropy_backward_input,
        torch.ops.d9d_kernels.linear_cross_entropy_backward_weight,
    ):
        torch.library.opcheck(op, (hidden, weight, labels, lse, grad, 0, CHUNK))


@requires_triton
def test_torch_compile_traces_through_without_graph_breaks():
    backend = TritonLinearCrossEntropy()
    hidden, weight, labels = _inputs(torch.float32)
    hidden.requires_grad_()
    compiled = torch.compile(
        lambda h: backend(h, weight, labels, chunk_size=CHUNK).sum(), backend="aot_eager", fullgraph=True
    )
    compiled(hidden).backward()
    want = torch.autograd.grad(linear_cross_entropy_reference(hidden, weight, labels).sum(), hidden)[0]
    close(hidden.grad, want, torch.float32)


def _maths():
    maths = [TorchChunkMath()]
    if HAS_TRITON:
        from d9d.kernels.linear_cross_entropy.triton_kernels import TritonChunkMath

        maths.append(TritonChunkMath())
    return maths


@pytest.mark.parametrize("math", _maths(), ids=lambda m: type(m).__name__)
def test_vocabulary_shards_compose_to_the_full_loss_and_gradients(math):
    """What a tensor-parallel head does with an all-reduce, done by hand over two uneven shards."""
    hidden, weight, labels = _inputs(torch.float32)
    bounds = [(0, 37), (37, VOCAB)]
    shards = [logit_stats(hidden, weight[a:b], labels, vocab_start=a, chunk_size=CHUNK, math=math) for a, b in bounds]
    combined = combine_logit_stats(shards)
    losses = losses_from_stats(combined, labels)
    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = linear_cross_entropy_reference(hs, ws, labels)
    grad = randn(TOKENS, seed=3)
    want.backward(grad)
    close(losses, want, torch.float32)
    parts = [
        logit_gradients(
            hidden, weight[a:b], labels, combined.logsumexp(), grad, vocab_start=a, chunk_size=CHUNK, math=math
        )
        for a, b in bounds
    ]
    close(parts[0][0] + parts[1][0], hs.grad, torch.float32, msg="hidden grads sum over shards")
    close(torch.cat([parts[0][1], parts[1][1]]), ws.grad, torch.float32, msg="weight grads are slices")


def test_bad_chunk_and_token_counts_are_named():
    hidden, weight, labels = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size must be positive, got 0"):
        EagerLinearCrossEntropy()(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="disagree on the token count"):
        EagerLinearCrossEntropy()(hidden, weight, labels[:-1])
    assert DEVICE in ("cpu", "cuda")
