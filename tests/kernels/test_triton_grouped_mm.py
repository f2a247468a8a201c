"""The Triton grouped GEMM beyond the shared backend tests: several row tiles per group, the split backward halves,
the custom ops' fake implementations and torch.compile."""

import torch
from triton_cases import DEVICE, DTYPES, close, randn, requires_triton

from d9d.kernels.grouped_mm import EagerGroupedMm, TritonGroupedMm

pytestmark = requires_triton
SIZES = [0, 130, 3, 70, 0]  # 130 rows: three 64-row tiles in one group; masked K (40) and M (24) tails


def _inputs(dtype):
    x = randn(sum(SIZES), 40, seed=0, dtype=dtype)
    weight = randn(len(SIZES), 24, 40, seed=1, dtype=dtype, scale=40**-0.5)
    return x, weight, torch.tensor(SIZES, device=DEVICE)


@DTYPES
def test_multi_tile_groups_match_eager_forward_and_backward(dtype):
    x, weight, sizes = _inputs(dtype)
    grad = randn(sum(SIZES), 24, seed=2, dtype=dtype)
    results = []
    for backend in (TritonGroupedMm(), EagerGroupedMm()):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = backend(xs, ws, sizes)
        out.backward(grad)
        results.append((out, xs.grad, ws.grad))
    for name, got, want in zip(("out", "grad x", "grad weight"), *results, strict=True):
        # bf16: float32 accumulation in both, one rounding of the output; the weight gradient sums up to 130 rows.
        close(got, want, dtype, fp32=1e-4, bf16=3e-2, msg=name)
    assert torch.all(results[0][2][0] == 0) and torch.all(results[0][2][4] == 0)


def test_split_backward_halves_and_ops_pass_opcheck():
    from d9d.kernels.grouped_mm import triton_kernels, triton_ops

    x, weight, sizes = _inputs(torch.float32)
    grad = randn(sum(SIZES), 24, seed=2)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    EagerGroupedMm()(xs, ws, sizes).backward(grad)
    close(triton_ops.grouped_mm_backward_input(grad, weight, sizes), xs.grad, torch.float32, fp32=1e-4)
    close(triton_ops.grouped_mm_backward_weight(grad, x, sizes), ws.grad, torch.float32, fp32=1e-4)
    offsets = triton_kernels.group_offsets(sizes)
    torch.library.opcheck(torch.ops.d9d_kernels.grouped_mm_forward, (x, weight, offsets))
    torch.library.opcheck(torch.ops.d9d_kernels.grouped_mm_backward_input, (grad, weight, offsets))
    torch.library.opcheck(torch.ops.d9d_kernels.grouped_mm_backward_weight, (grad, x, offsets))


def test_torch_compile_traces_through_without_graph_breaks():
    backend = TritonGroupedMm()
    x, weight, sizes = _inputs(torch.float32)
    weight.requires_grad_()
    torch.compile(lambda w: backend(x, w, sizes).square().sum(), backend="aot_eager", fullgraph=True)(weight).backward()
    want = torch.autograd.grad(EagerGroupedMm()(x, weight, sizes).square().sum(), weight)[0]
    close(weight.grad, want, torch.float32, fp32=1e-4)
