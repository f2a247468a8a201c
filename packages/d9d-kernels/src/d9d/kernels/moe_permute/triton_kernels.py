# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton row movers of the MoE permutation: a scaled gather, a weighted k-way combine, and row dot products.

The expert-parallel token exchange (`expert_dispatch/capacity_tokens.py`) uses the combine with "none" entries masked
and the row dots for its slot sums and its weight gradient."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.triton_support import row_block
from d9d.kernels.triton_support.tuning import autotune, warps_configs

_CONFIGS = warps_configs(4, 8, 2)


@autotune(_CONFIGS, key=["n_cols"])
@triton.jit
def _gather_kernel(
    src_ptr, index_ptr, scale_ptr, dst_ptr, n_cols, DIVISOR: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """`dst[j] = scale[index[j]] * src[index[j] // DIVISOR]`."""
    row = tl.program_id(0).to(tl.int64)
    flat = tl.load(index_ptr + row)
    source = flat // DIVISOR
    if HAS_SCALE:
        scale = tl.load(scale_ptr + flat).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        values = tl.load(src_ptr + source * n_cols + cols, mask=mask, other=0.0)
        if HAS_SCALE:
            values = values.to(tl.float32) * scale
        tl.store(dst_ptr + row * n_cols + cols, values.to(dst_ptr.dtype.element_ty), mask=mask)


@autotune(_CONFIGS, key=["n_cols"])
@triton.jit
def _combine_kernel(
    src_ptr, index_ptr, weights_ptr, dst_ptr, n_src, n_cols, TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    MASKED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """`dst[t] = sum_s weights[t, s] * src[index[t * TOP_K + s]]`, accumulated in float32, slots in order; with
    `MASKED` an index of `n_src` or more is "none" and adds nothing (the token exchange's slot sums)."""
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for slot in tl.static_range(TOP_K):
            source = tl.load(index_ptr + token * TOP_K + slot).to(tl.int64)
            row_mask = mask
            if MASKED:
                valid = source < n_src
                source = tl.where(valid, source, 0)
                row_mask = cols < tl.where(valid, n_cols, 0)  # a "none" entry reads nothing
            values = tl.load(src_ptr + source * n_cols + cols, mask=row_mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                values = values * tl.load(weights_ptr + token * TOP_K + slot).to(tl.float32)
            acc += values
        tl.store(dst_ptr + token * n_cols + cols, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@autotune(_CONFIGS, key=["n_cols"])
@triton.jit
def _dots_kernel(a_ptr, b_ptr, index_ptr, out_ptr, n_cols, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """`out[t * TOP_K + s] = <a[t], b[index[t * TOP_K + s]]>` in float32."""
    flat = tl.program_id(0).to(tl.int64)
    token = flat // TOP_K
    source = tl.load(index_ptr + flat)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + token * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + source * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + flat, tl.sum(acc, axis=0))


def gather(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None, divisor: int) -> torch.Tensor:
    rows, n_cols = index.shape[0], src.shape[1]
    dst = torch.empty((rows, n_cols), dtype=src.dtype, device=src.device)
    if rows:
        _gather_kernel[(rows,)](
            src, index, scale if scale is not None else src, dst, n_cols,
            DIVISOR=divisor, HAS_SCALE=scale is not None, BLOCK=row_block(n_cols),
        )  # fmt: skip
    return dst


def combine(
    src: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
    *,
    masked: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    tokens, n_cols = index.shape[0] // top_k, src.shape[1]
    dst = torch.empty((tokens, n_cols), dtype=dtype or src.dtype, device=src.device)
    if tokens:
        _combine_kernel[(tokens,)](
            src, index, weights if weights is not None else src, dst, src.shape[0], n_cols,
            TOP_K=top_k, HAS_WEIGHTS=weights is not None, MASKED=masked, BLOCK=row_block(n_cols),
        )  # fmt: skip
    return dst


def dots(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, top_k: int) -> torch.Tensor:
    out = torch.empty(index.shape[0], dtype=torch.float32, device=a.device)
    if index.shape[0]:
        _dots_kernel[(index.shape[0],)](a, b, index, out, a.shape[1], TOP_K=top_k, BLOCK=row_block(a.shape[1]))
    return out
