# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton rotary embedding of queries and keys in one launch (half style, partial rotary).

One program per token rotates all its query heads and then all its key heads, reading the token's cos/sin once.
With `x1, x2` the two halves of the rotated channels: forward `(x1 c1 - x2 s1, x2 c2 + x1 s2)`; backward is the
transpose, `(g1 c1 + g2 s2, g2 c2 - g1 s1)`, the same kernel with the sine terms swapped and negated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.triton_support import next_power_of_2
from d9d.kernels.triton_support.tuning import autotune, warps_configs


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, token, cos1, cos2, sin1, sin2, n_heads, head_dim, half,
    BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < half)
    base = token * n_heads * head_dim + heads * head_dim
    first = tl.load(src_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src_ptr + base + half + cols, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        out_first = first * cos1 + second * sin2
        out_second = second * cos2 - first * sin1
    else:
        out_first = first * cos1 - second * sin1
        out_second = second * cos2 + first * sin2
    tl.store(dst_ptr + base + cols, out_first.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + base + half + cols, out_second.to(dst_ptr.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:  # channels past rotary_dim pass through
        rest = tl.arange(0, BLOCK_PASS)[None, :]
        rest_mask = (heads < n_heads) & (rest < head_dim - 2 * half)
        passed = tl.load(src_ptr + base + 2 * half + rest, mask=rest_mask, other=0.0)
        tl.store(dst_ptr + base + 2 * half + rest, passed, mask=rest_mask)


@autotune(warps_configs(4, 2, 8), key=["q_heads", "k_heads", "head_dim"])
@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, q_heads, k_heads, head_dim, half,
    BACKWARD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    table = token * 2 * half
    cos1 = tl.load(cos_ptr + table + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, cos1, cos2, sin1, sin2, q_heads, head_dim, half,
                  BACKWARD, BLOCK_Q, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, token, cos1, cos2, sin1, sin2, k_heads, head_dim, half,
                  BACKWARD, BLOCK_K, BLOCK_HALF, BLOCK_PASS)  # fmt: skip


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q` `(tokens, q_heads, head_dim)`, `k` `(tokens, k_heads, head_dim)`, `cos`/`sin` `(tokens, rotary_dim)`, all
    contiguous. Forward rotation, or its transpose (the gradient) with `backward=True`."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    half = cos.shape[-1] // 2
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tokens:
        passed = head_dim - 2 * half
        _rope_kernel[(tokens,)](
            q, k, q_out, k_out, cos, sin, q_heads, k_heads, head_dim, half,
            BACKWARD=backward, BLOCK_Q=next_power_of_2(q_heads), BLOCK_K=next_power_of_2(k_heads),
            BLOCK_HALF=next_power_of_2(half), BLOCK_PASS=next_power_of_2(passed) if passed else 0,
        )  # fmt: skip
    return q_out, k_out
