# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton grouped GEMM: forward, input gradient and weight gradient, with no host synchronisation.

Row tiles are assigned to experts inside the kernel: each program reads the `E + 1` group offsets, counts every
expert's row tiles (`cdiv(rows_e, BLOCK_M)`) and finds its own by a prefix sum, so the launch grid is the fixed
upper bound `cdiv(N, BLOCK_M) + E` row tiles (programs past the last tile exit) and the group sizes never reach the
host. The weight gradient runs one program per `(expert, M tile, K tile)`, looping over that expert's rows.
The configs are a Hopper (sm90) search space; accumulation is float32, the output is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.triton_support import interpreting, next_power_of_2
from d9d.kernels.triton_support.tuning import autotune

# Triton's CPU interpreter multiplies bfloat16 tiles wrongly; exact float32 copies of them give the same products.
_UPCAST = interpreting()


def _configs(small: tuple[int, int, int]) -> list[triton.Config]:
    shapes = [small, (128, 128, 64), (128, 256, 64), (64, 256, 64), (128, 64, 64), (64, 128, 64)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for m, n, k in shapes
        for warps, stages in ((8, 3), (4, 4))
    ]


@autotune(_configs((64, 64, 32)), key=["n_out", "k_in"])
@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, offsets_ptr, n_out, k_in, n_groups, stride_be, stride_bk, stride_bn,
    BLOCK_GROUPS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`c[rows of e] = a[rows of e] @ B_e` with `B_e[k, n] = b[e * stride_be + k * stride_bk + n * stride_bn]`."""
    tile = tl.program_id(0)
    groups = tl.arange(0, BLOCK_GROUPS)
    group_mask = groups < n_groups
    starts = tl.load(offsets_ptr + groups, mask=group_mask, other=0)
    ends = tl.load(offsets_ptr + groups + 1, mask=group_mask, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cumulative = tl.cumsum(tiles, axis=0)
    if tile < tl.sum(tiles, axis=0):
        group = tl.sum((cumulative <= tile).to(tl.int32), axis=0)
        chosen = groups == group
        row_start = tl.sum(tl.where(chosen, starts, 0), axis=0)
        row_end = tl.sum(tl.where(chosen, ends, 0), axis=0)
        first_tile = tl.sum(tl.where(chosen, cumulative - tiles, 0), axis=0)
        rows = row_start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        row_mask = rows < row_end
        col_mask = cols < n_out
        rows64 = rows.to(tl.int64)
        b_base = b_ptr + group.to(tl.int64) * stride_be
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, k_in, BLOCK_K):
            k_mask = (k + inner) < k_in
            a = tl.load(
                a_ptr + rows64[:, None] * k_in + (k + inner)[None, :],
                mask=row_mask[:, None] & k_mask[None, :], other=0.0,
            )  # fmt: skip
            b = tl.load(
                b_base + (k + inner)[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=k_mask[:, None] & col_mask[None, :], other=0.0,
            )  # fmt: skip
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        tl.store(
            c_ptr + rows64[:, None] * n_out + cols[None, :], acc.to(c_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )  # fmt: skip


@autotune(_configs((32, 32, 32)), key=["m_out", "k_out"])
@triton.jit
def _grouped_weight_grad_kernel(
    grad_ptr, x_ptr, out_ptr, offsets_ptr, m_out, k_out, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """`out[e] = grad[rows of e].T @ x[rows of e]`: `(M, K)` per expert; empty experts get zeros."""
    tiles_n = tl.cdiv(k_out, BLOCK_N)
    tile_m = tl.program_id(0) // tiles_n
    tile_n = tl.program_id(0) % tiles_n
    group = tl.program_id(1)
    row_start = tl.load(offsets_ptr + group)
    row_end = tl.load(offsets_ptr + group + 1)
    ms = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_K):
        rows = (start + inner).to(tl.int64)
        row_mask = rows < row_end
        grad_t = tl.load(
            grad_ptr + rows[None, :] * m_out + ms[:, None], mask=row_mask[None, :] & (ms < m_out)[:, None], other=0.0
        )
        x = tl.load(
            x_ptr + rows[:, None] * k_out + ns[None, :], mask=row_mask[:, None] & (ns < k_out)[None, :], other=0.0
        )
        if UPCAST:
            grad_t, x = grad_t.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(grad_t, x, acc)
    out = out_ptr + group.to(tl.int64) * m_out * k_out + ms[:, None] * k_out + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ms < m_out)[:, None] & (ns < k_out)[None, :])


def group_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """`(E + 1,)` int32 row offsets on the device (a cumulative sum: no host sync)."""
    offsets = torch.zeros(group_sizes.shape[0] + 1, dtype=torch.int32, device=group_sizes.device)
    offsets[1:] = torch.cumsum(group_sizes, dim=0)
    return offsets


def _matmul(a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """`a (N, k_in)` times each group's `weight[e].T` (`transpose`) or `weight[e]`, `weight` `(E, M, K)`."""
    groups, m, k = weight.shape
    n_out, k_in = (m, k) if transpose else (k, m)
    stride_bk, stride_bn = (1, k) if transpose else (k, 1)
    out = torch.empty((a.shape[0], n_out), dtype=a.dtype, device=a.device)
    if a.shape[0] == 0 or n_out == 0:
        return out

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return triton.cdiv(a.shape[0], meta["BLOCK_M"]) + groups, triton.cdiv(n_out, meta["BLOCK_N"])

    _grouped_mm_kernel[grid](
        a, weight, out, offsets, n_out, k_in, groups, m * k, stride_bk, stride_bn,
        BLOCK_GROUPS=next_power_of_2(groups), UPCAST=_UPCAST,
    )  # fmt: skip
    return out


def forward(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _matmul(x, weight, offsets, transpose=True)


def backward_input(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _matmul(grad, weight, offsets, transpose=False)


def backward_weight(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, groups: int) -> torch.Tensor:
    m_out, k_out = grad.shape[1], x.shape[1]
    out = torch.empty((groups, m_out, k_out), dtype=x.dtype, device=x.device)
    if groups == 0 or m_out == 0 or k_out == 0:
        return out

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return triton.cdiv(m_out, meta["BLOCK_M"]) * triton.cdiv(k_out, meta["BLOCK_N"]), groups

    _grouped_weight_grad_kernel[grid](grad, x, out, offsets, m_out, k_out, UPCAST=_UPCAST)
    return out
