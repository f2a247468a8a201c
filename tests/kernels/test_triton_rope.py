"""Triton RoPE (q and k in one kernel) against the eager rotation, forward and backward, partial rotary too."""

import pytest
import torch
from triton_cases import DTYPES, close, randn, requires_triton

from d9d.kernels.rope import EagerRope, TritonRope

pytestmark = requires_triton
BATCH, SEQ, Q_HEADS, K_HEADS, HEAD_DIM = 2, 5, 6, 3, 16


def _tables(rotary_dim, dtype, batch=BATCH):
    positions = torch.arange(SEQ, dtype=torch.float32)[None, :].expand(batch, SEQ)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = positions[..., None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    q = randn(1, seed=0)  # the device of the test
    return angles.cos().to(q.device, dtype), angles.sin().to(q.device, dtype)


def _run(backend, dtype, rotary_dim, table_batch=BATCH):
    q = randn(BATCH, SEQ, Q_HEADS, HEAD_DIM, seed=0, dtype=dtype).requires_grad_()
    k = randn(BATCH, SEQ, K_HEADS, HEAD_DIM, seed=1, dtype=dtype).requires_grad_()
    cos, sin = _tables(rotary_dim, dtype, table_batch)
    q_out, k_out = backend(q, k, cos, sin)
    torch.autograd.backward(
        [q_out, k_out], [randn(*q.shape, seed=2, dtype=dtype), randn(*k.shape, seed=3, dtype=dtype)]
    )
    return q_out, k_out, q.grad, k.grad


@DTYPES
@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, 10], ids=["full", "partial"])
def test_triton_rope_matches_eager_forward_and_backward(dtype, rotary_dim):
    got, want = _run(TritonRope(), dtype, rotary_dim), _run(EagerRope(), dtype, rotary_dim)
    for name, g, w in zip(("q", "k", "grad_q", "grad_k"), got, want, strict=True):
        close(g, w, dtype, msg=name)


def test_tables_broadcast_over_the_batch():
    got, want = _run(TritonRope(), torch.float32, HEAD_DIM, 1), _run(EagerRope(), torch.float32, HEAD_DIM, 1)
    for g, w in zip(got, want, strict=True):
        close(g, w, torch.float32)


def test_backward_half_is_the_transpose_and_ops_pass_opcheck():
    from d9d.kernels.rope import ops

    q, k = randn(SEQ, Q_HEADS, HEAD_DIM, seed=0), randn(SEQ, K_HEADS, HEAD_DIM, seed=1)
    cos, sin = (t[0] for t in _tables(HEAD_DIM, torch.float32))
    torch.library.opcheck(torch.ops.d9d_kernels.rope_forward, (q, k, cos, sin))
    torch.library.opcheck(torch.ops.d9d_kernels.rope_backward_input, (q, k, cos, sin))
    # <R x, y> == <x, R^T y>: the backward is the transpose of the forward rotation.
    gq, gk = randn(*q.shape, seed=2), randn(*k.shape, seed=3)
    rq, rk = torch.ops.d9d_kernels.rope_forward(q, k, cos, sin)
    tq, tk = ops.rope_backward_input(gq[None], gk[None], cos[None], sin[None])
    close((rq * gq).sum() + (rk * gk).sum(), (q * tq[0]).sum() + (k * tk[0]).sum(), torch.float32)


def test_torch_compile_traces_through_without_graph_breaks():
    backend = TritonRope()
    q = randn(BATCH, SEQ, Q_HEADS, HEAD_DIM, seed=0).requires_grad_()
    k = randn(BATCH, SEQ, K_HEADS, HEAD_DIM, seed=1)
    cos, sin = _tables(HEAD_DIM, torch.float32)
    compiled = torch.compile(
        lambda q, k: sum(t.square().sum() for t in backend(q, k, cos, sin)), backend="aot_eager", fullgraph=True
    )
    compiled(q, k).backward()
    want = torch.autograd.grad(sum(t.square().sum() for t in EagerRope()(q, k, cos, sin)), q)[0]
    close(q.grad, want, torch.float32)


def test_bad_tables_are_named():
    q, k = randn(BATCH, SEQ, Q_HEADS, HEAD_DIM, seed=0), randn(BATCH, SEQ, K_HEADS, HEAD_DIM, seed=1)
    cos, sin = _tables(HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="even rotary_dim <= head_dim=16"):
        TritonRope()(q, k, cos[..., :7], sin[..., :7])
