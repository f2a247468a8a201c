"""Triton RMSNorm (+ residual add) against the eager reference, forward and both halves of backward."""

import pytest
import torch
from triton_cases import DEVICE, DTYPES, close, randn, requires_triton

from d9d.kernels.rms_norm import EagerRmsNorm, TritonRmsNorm, build_rms_norm, rms_norm_reference

pytestmark = requires_triton
ROWS, COLS = 6, 48  # 48 is not a power of two: the masked tail of the block is exercised


def _run(backend, dtype, residual, weight_dtype=None):
    x = randn(2, 3, COLS, seed=0, dtype=dtype).requires_grad_()
    res = randn(2, 3, COLS, seed=1, dtype=dtype).requires_grad_() if residual else None
    weight = (1 + randn(COLS, seed=2, scale=0.1)).to(weight_dtype or dtype).requires_grad_()
    out, summed = backend(x, weight, eps=1e-6, residual=res)
    grad_out, grad_summed = randn(*out.shape, seed=3, dtype=out.dtype), randn(*summed.shape, seed=4, dtype=dtype)
    loss = (out * grad_out).sum() + ((summed * grad_summed).sum() if residual else 0)
    loss.backward()
    grads = (x.grad, res.grad if residual else None, weight.grad)
    return out, summed, grads


@DTYPES
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_triton_rms_norm_matches_eager_forward_and_backward(dtype, residual):
    got_out, got_summed, got_grads = _run(TritonRmsNorm(), dtype, residual)
    want_out, want_summed, want_grads = _run(EagerRmsNorm(), dtype, residual)
    assert got_out.dtype == want_out.dtype == dtype
    close(got_out, want_out, dtype, msg="out")
    # The residual sum is one rounding of the same float32 sum in both: bit-equal on a GPU. Triton's CPU interpreter
    # rounds to bfloat16 by truncation (not to nearest), so there it may differ by one bf16 ulp (2^-7 relative).
    exact = DEVICE == "cuda" or dtype == torch.float32
    torch.testing.assert_close(got_summed, want_summed, atol=0 if exact else 1e-2, rtol=0 if exact else 8e-3)
    for name, got, want in zip(("x", "residual", "weight"), got_grads, want_grads, strict=True):
        if want is None:
            assert got is None
            continue
        # bf16 weight gradient: a sum over 6 rows, each product rounded to bf16 in eager but not in the kernel.
        close(got, want, dtype, bf16=3e-2, msg=name)


def test_float32_weight_with_bf16_activations_gives_float32_output_and_weight_grad():
    got_out, _, got_grads = _run(TritonRmsNorm(), torch.bfloat16, True, weight_dtype=torch.float32)
    want_out, _, want_grads = _run(EagerRmsNorm(), torch.bfloat16, True, weight_dtype=torch.float32)
    assert got_out.dtype == torch.float32 and got_grads[2].dtype == torch.float32
    close(got_out, want_out, torch.bfloat16)
    close(got_grads[2], want_grads[2], torch.bfloat16)


def test_split_backward_halves_equal_the_autograd_backward():
    from d9d.kernels.rms_norm import ops

    x, residual = randn(ROWS, COLS, seed=0), randn(ROWS, COLS, seed=1)
    weight = 1 + randn(COLS, seed=2, scale=0.1)
    grad_out, grad_summed = randn(ROWS, COLS, seed=3), randn(ROWS, COLS, seed=4)
    out, summed, rstd = torch.ops.d9d_kernels.rms_norm_forward(x, residual, weight, 1e-6, torch.float32)
    grad_in = ops.rms_norm_backward_input(grad_out, summed, rstd, weight, grad_summed)
    grad_weight = ops.rms_norm_backward_weight(grad_out, summed, rstd, torch.float32)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, residual, weight))
    ref_out, ref_summed = rms_norm_reference(xs, ws, eps=1e-6, residual=rs)
    torch.autograd.backward([ref_out, ref_summed], [grad_out, grad_summed])
    close(out, ref_out, torch.float32)
    close(grad_in, xs.grad, torch.float32)
    close(grad_in, rs.grad, torch.float32)
    close(grad_weight, ws.grad, torch.float32)


def test_custom_ops_pass_opcheck():
    x, residual, weight = randn(ROWS, COLS, seed=0), randn(ROWS, COLS, seed=1), randn(COLS, seed=2)
    out, summed, rstd = torch.ops.d9d_kernels.rms_norm_forward(x, residual, weight, 1e-6, torch.float32)
    torch.library.opcheck(torch.ops.d9d_kernels.rms_norm_forward, (x, residual, weight, 1e-6, torch.float32))
    torch.library.opcheck(torch.ops.d9d_kernels.rms_norm_forward, (x, None, weight, 1e-6, torch.float32))
    torch.library.opcheck(torch.ops.d9d_kernels.rms_norm_backward_input, (out, summed, rstd, weight, x))
    torch.library.opcheck(torch.ops.d9d_kernels.rms_norm_backward_weight, (out, summed, rstd, torch.float32))


def test_torch_compile_traces_through_the_kernel_without_graph_breaks():
    backend = TritonRmsNorm()
    x, residual = randn(ROWS, COLS, seed=0).requires_grad_(), randn(ROWS, COLS, seed=1)
    weight = randn(COLS, seed=2).requires_grad_()

    def step(x, residual, weight):
        out, summed = backend(x, weight, eps=1e-6, residual=residual)
        return (out.square().sum() + summed.sum(),)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    (loss,) = compiled(x, residual, weight)
    loss.backward()
    (want,) = step(x.detach(), residual, weight.detach())
    close(loss, want, torch.float32)
    assert x.grad is not None and weight.grad is not None


def test_auto_selection_is_eager_on_cpu_and_errors_name_the_shapes(monkeypatch):
    monkeypatch.delenv("D9D_BACKEND_AUTO_RMS_NORM", raising=False)
    if DEVICE == "cpu":
        assert build_rms_norm().name == "eager"
    with pytest.raises(ValueError, match=r"weight must be \(48,\)"):
        TritonRmsNorm()(randn(2, COLS, seed=0), randn(COLS + 1, seed=1), eps=1e-6)
