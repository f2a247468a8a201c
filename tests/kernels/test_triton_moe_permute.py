"""MoE permute/unpermute: Triton against the eager indexing, forward and backward, with empty experts."""

import torch
from triton_cases import DEVICE, DTYPES, close, randn, requires_triton

from d9d.kernels.moe_permute import EagerMoePermute, TritonMoePermute, sort_by_expert

pytestmark = requires_triton
TOKENS, TOP_K, EXPERTS, HIDDEN = 9, 3, 6, 20


def _routing():
    generator = torch.Generator().manual_seed(0)
    # Experts 0..3 only: 4 and 5 stay empty; each token picks 3 distinct experts.
    indices = torch.stack([torch.randperm(4, generator=generator)[:TOP_K] for _ in range(TOKENS)]).to(DEVICE)
    return indices, torch.softmax(randn(TOKENS, TOP_K, seed=1), dim=-1)


def test_sort_by_expert_counts_and_orders_stably():
    indices, _ = _routing()
    order, inverse, sizes = sort_by_expert(indices, EXPERTS)
    flat = indices.reshape(-1)
    assert sizes.tolist() == torch.bincount(flat, minlength=EXPERTS).tolist() and sizes[4] == sizes[5] == 0
    assert torch.all(flat[order][1:] >= flat[order][:-1])  # sorted by expert
    assert torch.equal(order[inverse], torch.arange(TOKENS * TOP_K, device=DEVICE))


def _run(backend, dtype):
    indices, weights = _routing()
    order, inverse, _ = sort_by_expert(indices, EXPERTS)
    x = randn(TOKENS, HIDDEN, seed=2, dtype=dtype).requires_grad_()
    w = weights.to(dtype).requires_grad_()
    rows = backend.permute(x, order, TOP_K)
    expert_out = rows * randn(TOKENS * TOP_K, 1, seed=3, dtype=dtype)  # something row-dependent between the two
    out = backend.unpermute(expert_out, inverse, w)
    out.backward(randn(TOKENS, HIDDEN, seed=4, dtype=dtype))
    return rows, out, x.grad, w.grad


@DTYPES
def test_triton_permute_and_unpermute_match_eager(dtype):
    got, want = _run(TritonMoePermute(), dtype), _run(EagerMoePermute(), dtype)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)  # permute is a copy: bit-equal
    for name, g, w in zip(("out", "grad x", "grad weights"), got[1:], want[1:], strict=True):
        assert g.dtype == dtype
        close(g, w, dtype, msg=name)


def test_ops_pass_opcheck():
    indices, weights = _routing()
    order, inverse, _ = sort_by_expert(indices, EXPERTS)
    x, rows = randn(TOKENS, HIDDEN, seed=2), randn(TOKENS * TOP_K, HIDDEN, seed=3)
    torch.library.opcheck(torch.ops.d9d_kernels.moe_gather_rows, (x, order, None, TOP_K))
    torch.library.opcheck(torch.ops.d9d_kernels.moe_gather_rows, (x, order, weights.reshape(-1), TOP_K))
    torch.library.opcheck(torch.ops.d9d_kernels.moe_combine_rows, (rows, inverse, weights.reshape(-1), TOP_K))
    torch.library.opcheck(torch.ops.d9d_kernels.moe_row_dots, (x, rows, inverse, TOP_K))


def test_torch_compile_traces_through_without_graph_breaks():
    backend = TritonMoePermute()
    indices, weights = _routing()
    x = randn(TOKENS, HIDDEN, seed=2).requires_grad_()

    def step(x):
        order, inverse, _ = sort_by_expert(indices, EXPERTS)
        return backend.unpermute(backend.permute(x, order, TOP_K).square(), inverse, weights).sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(x).backward()
    close(x.grad, 2 * x.detach() * weights.sum(dim=1, keepdim=True), torch.float32)
