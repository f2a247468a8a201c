# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton row movers of the token-level exchange (design 0031): a masked, weighted K-way gather-sum and row dots.

Imported only where the rows are on a GPU (or under `TRITON_INTERPRET=1`, by the tests): `capacity_tokens` falls
back to its PyTorch reference elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.triton_support import row_block
from d9d.kernels.triton_support.tuning import autotune, warps_configs

_CONFIGS = warps_configs(4, 8, 2)


@autotune(_CONFIGS, key=["n_cols"])
@triton.jit
def _gather_sum_kernel(
    src_ptr, index_ptr, weights_ptr, dst_ptr, n_src, n_cols, K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """`dst[o] = sum_j weights[o, j] * src[index[o, j]]` over `j` with `index[o, j] < n_src`, in float32, `j` in
    order: a slot's copies, or a token's destinations, added in a fixed order (deterministic)."""
    out = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            source = tl.load(index_ptr + out * K + j).to(tl.int64)
            valid = source < n_src
            safe = tl.where(valid, source, 0)
            # A "none" entry reads nothing: its row's columns all count as out of range.
            row_mask = cols < tl.where(valid, n_cols, 0)
            values = tl.load(src_ptr + safe * n_cols + cols, mask=row_mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                values = values * tl.load(weights_ptr + out * K + j).to(tl.float32)
            acc += values
        tl.store(dst_ptr + out * n_cols + cols, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@autotune(_CONFIGS, key=["n_cols"])
@triton.jit
def _row_dots_kernel(a_ptr, a_index_ptr, b_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """`out[p] = <a[a_index[p]], b[p]>` in float32."""
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(a_index_ptr + row).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + source * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def gather_sum(
    src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    src, index = src.contiguous(), index.contiguous()
    outputs, k = index.shape
    dst = torch.empty((outputs, src.shape[1]), dtype=dtype, device=src.device)
    if outputs:
        _gather_sum_kernel[(outputs,)](
            src, index, weights.contiguous() if weights is not None else src, dst, src.shape[0], src.shape[1],
            K=k, HAS_WEIGHTS=weights is not None, BLOCK=row_block(src.shape[1]),
        )  # fmt: skip
    return dst


def row_dots(a: torch.Tensor, a_index: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, a_index, b = a.contiguous(), a_index.contiguous(), b.contiguous()
    out = torch.empty(b.shape[0], dtype=torch.float32, device=b.device)
    if b.shape[0]:
        _row_dots_kernel[(b.shape[0],)](a, a_index, b, out, b.shape[1], BLOCK=row_block(b.shape[1]))
    return out
