# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton RMSNorm with a fused residual add: one program per row, statistics in float32.

Rounding follows the eager reference (`reference.py`) step by step: the residual sum is rounded to the activation
dtype (it is the residual stream the next layer reads), the normalised row is rounded to the activation dtype
before the weight multiplies it, and the product is rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.triton_support import next_power_of_2, reduction_programs
from d9d.kernels.triton_support.tuning import autotune, warps_configs

_ROW_CONFIGS = warps_configs(4, 8, 16, 2)


@autotune(_ROW_CONFIGS, key=["n_cols"])
@triton.jit
def _forward_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, rstd_ptr, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@autotune(_ROW_CONFIGS, key=["n_cols"])
@triton.jit
def _backward_input_kernel(
    grad_out_ptr, summed_ptr, rstd_ptr, weight_ptr, grad_residual_ptr, grad_in_ptr, n_cols,
    HAS_GRAD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    grad_out = tl.load(grad_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(summed_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    normed = x * rstd
    grad_normed = grad_out * weight
    # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
    grad = rstd * (grad_normed - normed * (tl.sum(grad_normed * normed, axis=0) / n_cols))
    if HAS_GRAD_RESIDUAL:
        grad += tl.load(grad_residual_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_in_ptr + row * n_cols + cols, grad.to(grad_in_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_weight_kernel(
    grad_out_ptr, summed_ptr, rstd_ptr, partial_ptr, n_rows, n_cols, BLOCK: tl.constexpr
):  # fmt: skip
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(program, n_rows, programs):
        offset = (row + tl.zeros([], dtype=tl.int64)) * n_cols + cols  # int64: rows x cols may pass 2^31
        grad_out = tl.load(grad_out_ptr + offset, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(summed_ptr + offset, mask=mask, other=0.0).to(tl.float32)
        normed = (x * tl.load(rstd_ptr + row)).to(summed_ptr.dtype.element_ty).to(tl.float32)
        acc += grad_out * normed
    tl.store(partial_ptr + program * n_cols + cols, acc, mask=mask)


def forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`(out, summed or None, rstd)` for contiguous `(rows, cols)` inputs."""
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _forward_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, summed if summed is not None else out, rstd,
            cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(cols),
        )  # fmt: skip
    return out, summed, rstd


def backward_input(
    grad_out: torch.Tensor,
    summed: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    grad_residual: torch.Tensor | None,
) -> torch.Tensor:
    rows, cols = summed.shape
    grad_in = torch.empty_like(summed)
    if rows:
        _backward_input_kernel[(rows,)](
            grad_out, summed, rstd, weight, grad_residual if grad_residual is not None else grad_out, grad_in, cols,
            HAS_GRAD_RESIDUAL=grad_residual is not None, BLOCK=next_power_of_2(cols),
        )  # fmt: skip
    return grad_in


def backward_weight(grad_out: torch.Tensor, summed: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The weight gradient in float32 (the caller casts it to the weight's dtype)."""
    rows, cols = summed.shape
    programs = reduction_programs(rows, summed.device)
    partial = torch.zeros((programs, cols), dtype=torch.float32, device=summed.device)
    if rows:
        _backward_weight_kernel[(programs,)](grad_out, summed, rstd, partial, rows, cols, BLOCK=next_power_of_2(cols))
    return partial.sum(dim=0)
