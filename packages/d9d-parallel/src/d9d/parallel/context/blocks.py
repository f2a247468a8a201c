"""Attention of a block of queries against a block of keys that returns its log-sum-exp, and the matching backward.

Ring attention combines the partial results of several key blocks with their log-sum-exp (online softmax), and in
backward recomputes each block's probabilities from the *final* log-sum-exp and output, so every block's gradient
is exact on its own. Layout: `q` `(batch, sq, H, D)`, `k`/`v` `(batch, sk, H_kv, D)` with `H_kv` dividing `H`
(grouped-query attention by broadcasting, never by copying, in the eager kernel); `out` `(batch, sq, H, D)` and
`lse` `(batch, sq, H)` are float32.

The eager kernel (float32 scores) runs anywhere and is the reference. On CUDA with float16/bfloat16 inputs and no
document mask, PyTorch's flash kernel does the block (`aten._scaled_dot_product_flash_attention` returns the
log-sum-exp and its backward takes the final one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BlockMask:
    """Which keys each query of a block may see: `causal` is the lower triangle of a square (diagonal) block;
    `allowed` `(batch, sq, sk)` further restricts (same document). Neither: every key."""

    causal: bool = False
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class FlashAux:
    """What the flash backward op needs from a forward besides out/lse: its (undefined, for dense inputs) varlen
    offsets and (unused without dropout) RNG state, exactly as the forward op returned them. An empty but defined
    offsets tensor would switch the backward to the variable-length kernel."""

    cum_seq_q: Any
    cum_seq_k: Any
    philox_seed: Any
    philox_offset: Any


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q as `(b, H_kv, g, sq, D)` and k (or v) as `(b, H_kv, 1, sk, D)`, both float32."""
    batch, sq, heads, dim = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    qg = q.float().view(batch, sq, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
    kg = k.float().permute(0, 2, 1, 3)[:, :, None]
    return qg, kg


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    """`(b, H_kv, g, s, D)` back to `(b, s, H, D)`."""
    batch, kv_heads, groups, seq, dim = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(batch, seq, kv_heads * groups, dim)


def _allowed(mask: BlockMask, sq: int, sk: int, device: torch.device) -> torch.Tensor | None:
    """Boolean `(b or 1, 1, 1, sq, sk)` or None when every key is visible."""
    allowed: torch.Tensor | None = None
    if mask.causal:
        if sq != sk:
            raise ValueError(f"a causal block must be square, got {sq} queries and {sk} keys")
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()[None]
    if mask.allowed is not None:
        allowed = mask.allowed if allowed is None else allowed & mask.allowed
    return None if allowed is None else allowed[:, None, None]


def _probabilities(scores: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """exp(scores - lse), zero where masked and on rows that see no key (lse = -inf)."""
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite[..., None])
    if allowed is not None:
        probs = probs.masked_fill(~allowed, 0.0)
    return probs


def eager_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: BlockMask
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of one block in float32; rows that see no key get `out = 0`, `lse = -inf`."""
    qg, kg = _grouped(q, k)
    _, vg = _grouped(q, v)
    scores = torch.matmul(qg, kg.transpose(-2, -1)) * scale
    allowed = _allowed(mask, q.shape[1], k.shape[1], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(_probabilities(scores, lse, allowed), vg)
    return _ungroup(out), _ungroup(lse[..., None]).squeeze(-1)


def eager_block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: BlockMask,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (float32) of this block's share of the loss, given the final `out`/`lse` of these queries."""
    qg, kg = _grouped(q, k)
    _, vg = _grouped(q, v)
    dog, og = _grouped(grad_out, k)[0], _grouped(out, k)[0]
    lse_g = _grouped(lse[..., None], k)[0].squeeze(-1)
    scores = torch.matmul(qg, kg.transpose(-2, -1)) * scale
    probs = _probabilities(scores, lse_g, _allowed(mask, q.shape[1], k.shape[1], q.device))
    grad_v = torch.matmul(probs.transpose(-2, -1), dog).sum(dim=2)
    grad_probs = torch.matmul(dog, vg.transpose(-2, -1))
    delta = (dog * og).sum(dim=-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta)
    grad_q = torch.matmul(grad_scores, kg) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), qg).sum(dim=2) * scale
    return _ungroup(grad_q), grad_k.permute(0, 2, 1, 3), grad_v.permute(0, 2, 1, 3)


def flash_applies(q: torch.Tensor, mask: BlockMask) -> bool:
    """The flash kernel can do this block: CUDA, half precision, no document mask."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and mask.allowed is None


def _expand_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """`(b, s, H_kv, D)` -> `(b, H, s, D)`: the aten flash op takes equal head counts."""
    groups = q.shape[2] // kv.shape[2]
    heads_first = kv.transpose(1, 2)
    return heads_first.repeat_interleave(groups, dim=1) if groups > 1 else heads_first


def flash_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: BlockMask
) -> tuple[torch.Tensor, torch.Tensor, FlashAux]:
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2),
        _expand_kv(q, k),
        _expand_kv(q, v),
        dropout_p=0.0,
        is_causal=mask.causal,
        return_debug_mask=False,
        scale=scale,
    )
    out, lse = result[0], result[1]
    aux = FlashAux(cum_seq_q=result[2], cum_seq_k=result[3], philox_seed=result[6], philox_offset=result[7])
    return out.transpose(1, 2).float(), lse.transpose(1, 2).float(), aux


def flash_block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: BlockMask,
    aux: FlashAux,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, sq, heads, _ = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.to(q.dtype).transpose(1, 2),
        q.transpose(1, 2),
        _expand_kv(q, k),
        _expand_kv(q, v),
        out.to(q.dtype).transpose(1, 2),
        lse.transpose(1, 2).contiguous(),
        aux.cum_seq_q,
        aux.cum_seq_k,
        sq,
        sk,
        0.0,
        mask.causal,
        aux.philox_seed,
        aux.philox_offset,
        scale=scale,
    )
    groups = heads // kv_heads

    def reduce_groups(grad: torch.Tensor) -> torch.Tensor:
        # (b, H, sk, D) -> (b, sk, H_kv, D): sum the query heads that shared a key/value head.
        return grad.float().view(batch, kv_heads, groups, sk, -1).sum(dim=2).transpose(1, 2)

    return grad_q.float().transpose(1, 2), reduce_groups(grad_k), reduce_groups(grad_v)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: BlockMask
) -> tuple[torch.Tensor, torch.Tensor, FlashAux | None]:
    """`(out, lse, aux)`: `aux` is set when the flash kernel ran (keep one for `block_backward`)."""
    if flash_applies(q, mask):
        return flash_block_forward(q, k, v, scale=scale, mask=mask)
    out, lse = eager_block_forward(q, k, v, scale=scale, mask=mask)
    return out, lse, None


def block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: BlockMask,
    flash_aux: FlashAux | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_aux`: from any flash forward of the same call (dense inputs, no dropout: the same for every block)."""
    if flash_applies(q, mask):
        if flash_aux is None:
            raise RuntimeError("a flash block in backward needs the FlashAux of a flash forward")
        return flash_block_backward(grad_out, q, k, v, out=out, lse=lse, scale=scale, mask=mask, aux=flash_aux)
    return eager_block_backward(grad_out, q, k, v, out=out, lse=lse, scale=scale, mask=mask)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of a block's `(out, lse)` into the running ones (all float32, same shapes)."""
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    # exp(-inf - finite) = 0: a side that has seen no key contributes nothing; rows nobody saw stay 0 / -inf.
    old = torch.exp(lse - finite)[..., None]
    new = torch.exp(block_lse - finite)[..., None]
    return out * old + block_out * new, merged
