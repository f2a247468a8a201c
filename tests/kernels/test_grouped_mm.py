"""Grouped matmul backends against a per-group reference, empty groups and both precisions included."""

import pytest
import torch
from backends import available_grouped_mm
from torch.nn import functional

from d9d.kernels.grouped_mm import EagerGroupedMm

BACKENDS = available_grouped_mm("cpu")
SIZES = [5, 0, 11, 3, 0, 13]  # uneven, with empty groups


def _inputs(dtype, k=16, m=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SIZES), k, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(len(SIZES), m, k, generator=generator) / k**0.5).to(dtype).requires_grad_()
    return x, weight, torch.tensor(SIZES)


def _reference(x, weight):
    parts = torch.split(x, SIZES)
    return torch.cat([functional.linear(part.double(), weight[e].double()) for e, part in enumerate(parts)])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_per_group_reference(backend, dtype):
    x, weight, sizes = _inputs(dtype)
    out = backend(x, weight, sizes)
    assert out.dtype == dtype
    assert out.shape == (sum(SIZES), 24)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    # A real (non-expanded) incoming gradient: torch._grouped_mm's CPU backward rejects expanded ones.
    out.backward(grad)
    xd, wd = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = _reference(xd, wd)
    ref.backward(grad.double())
    # fp32: exact up to summation order; bf16: inputs are exact, outputs and gradients are rounded to bf16 (2^-8).
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(weight.grad.double(), wd.grad, atol=tol, rtol=tol)
    assert torch.all(weight.grad[1] == 0) and torch.all(weight.grad[4] == 0)  # empty groups get zero gradient


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_rows_past_the_groups_are_padding_that_changes_nothing(backend):
    # sum(group_sizes) < N: the last rows belong to no group (all_to_all_capacity's padding, design 0029). The
    # grouped rows' outputs and gradients and the weight gradient are those without padding; the padding rows'
    # outputs and input gradients are unspecified, except eager (the reference), which gives zeros.
    x, weight, sizes = _inputs(torch.float32)
    padding = torch.full((5, x.shape[1]), 7.0)  # large values: any leak into the weight gradient would show
    padded = torch.cat([x.detach(), padding]).requires_grad_()
    out = backend(padded, weight, sizes)
    assert out.shape == (sum(SIZES) + 5, 24)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (grad_x, grad_w) = torch.autograd.grad((out * grad).sum(), (padded, weight))
    ref = backend(x, weight, sizes)
    ref_x, ref_w = torch.autograd.grad((ref * grad[: sum(SIZES)]).sum(), (x, weight))
    # float32, the same kernels on the same grouped rows: equal up to how a backend tiles the longer buffer.
    torch.testing.assert_close(out[: sum(SIZES)], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_x[: sum(SIZES)], ref_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_w, ref_w, atol=1e-5, rtol=1e-5)
    if backend.name == "eager":
        assert not out[sum(SIZES) :].any() and not grad_x[sum(SIZES) :].any()


def test_group_sizes_must_fit_the_rows():
    x, weight, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"sum to 33 but x has only 32 rows .*at most the row count"):
        EagerGroupedMm()(x, weight, torch.tensor([5, 0, 11, 3, 0, 14]))


def test_weight_shape_errors_name_the_expected_shape():
    x, weight, sizes = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"need weight \(E=6, M, K=16\)"):
        EagerGroupedMm()(x, weight.transpose(1, 2), sizes)
