# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton per-chunk math of the fused linear + cross-entropy: one program per token row of a logits chunk.

`stats` streams the row once (online max and rescaled sum of exponentials, float32); `gradient` streams it once more
and overwrites the logits with `(softmax - onehot) * scale` in their own dtype, so backward needs no second buffer.
`stats_and_gradient` (the summed loss's forward) does both in one program per row: the softmax needs the row's
log-sum-exp before its first element can be written, so it is two sweeps, but the second follows the first at once,
while the row (300 KB at vocabulary 151,936 in bf16) may still be in L2, rather than a second kernel re-reading the
whole chunk (600 MB at 2,048 tokens) after it has left. How much of the second sweep hits L2 depends on how many rows
run at once (an H100's 50 MB holds about 170 rows); at worst it moves the bytes of the two kernels it replaces, with
one launch and one read of the targets fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.linear_cross_entropy.chunks import IGNORE_INDEX
from d9d.kernels.triton_support.tuning import autotune

_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
    triton.Config({"BLOCK": 8192}, num_warps=16),
]


@autotune(_CONFIGS, key=["n_vocab"])
@triton.jit
def _stats_kernel(
    logits_ptr, targets_ptr, max_ptr, sum_ptr, target_ptr, n_vocab, vocab_start, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * n_vocab
    maximum = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(maximum, tl.max(values, axis=0))
        total = total * tl.exp(maximum - new_max) + tl.sum(tl.exp(values - new_max), axis=0)
        maximum = new_max
    tl.store(max_ptr + row, maximum)
    tl.store(sum_ptr + row, total)
    local = tl.load(targets_ptr + row) - vocab_start
    inside = (local >= 0) & (local < n_vocab)
    target = tl.load(base + tl.where(inside, local, 0)).to(tl.float32)
    tl.store(target_ptr + row, tl.where(inside, target, 0.0))


@autotune(_CONFIGS, key=["n_vocab"], restore_value=["logits_ptr"])  # in place: restored between tuning runs
@triton.jit
def _gradient_kernel(
    logits_ptr, targets_ptr, lse_ptr, scale_ptr, n_vocab, vocab_start, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * n_vocab
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    local = tl.load(targets_ptr + row) - vocab_start  # negative or past the shard: no onehot term here
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        probs = tl.exp(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) - lse)
        probs = tl.where(cols == local, probs - 1.0, probs)
        tl.store(base + cols, (probs * scale).to(logits_ptr.dtype.element_ty), mask=mask)


@autotune(_CONFIGS, key=["n_vocab"], restore_value=["logits_ptr"])  # in place: restored between tuning runs
@triton.jit
def _stats_and_gradient_kernel(
    logits_ptr, targets_ptr, max_ptr, sum_ptr, target_ptr, n_vocab, ignore_index, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * n_vocab
    label = tl.load(targets_ptr + row)
    maximum = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    target = tl.full([], 0.0, tl.float32)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(maximum, tl.max(values, axis=0))
        total = total * tl.exp(maximum - new_max) + tl.sum(tl.exp(values - new_max), axis=0)
        maximum = new_max
        # The target's logit is picked up in this sweep, not read back later: the sweep below overwrites the row,
        # and a warp running ahead into it could otherwise beat another warp's read of that element.
        target += tl.sum(tl.where(cols == label, values, 0.0), axis=0)
    valid = label != ignore_index
    tl.store(max_ptr + row, maximum)
    tl.store(sum_ptr + row, total)
    tl.store(target_ptr + row, target)  # 0 when the label is outside the vocabulary (ignored)
    lse = maximum + tl.log(total)
    scale = tl.where(valid, 1.0, 0.0)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        probs = tl.exp(tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) - lse)
        probs = tl.where(cols == label, probs - 1.0, probs)
        tl.store(base + cols, (probs * scale).to(logits_ptr.dtype.element_ty), mask=mask)


class TritonChunkMath:
    """The two per-chunk steps as Triton kernels (contiguous logits; the chunk matmul's output is)."""

    def stats(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, vocab = logits.shape
        out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)]
        if rows:
            _stats_kernel[(rows,)](logits.contiguous(), targets.contiguous(), *out, vocab, vocab_start)
        return out[0], out[1], out[2]

    def gradient(
        self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int
    ) -> torch.Tensor:
        logits = logits.contiguous()
        rows, vocab = logits.shape
        if rows:
            _gradient_kernel[(rows,)](
                logits, targets.contiguous(), lse.contiguous(), scale.contiguous(), vocab, vocab_start
            )
        return logits

    def stats_and_gradient(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = logits.contiguous()
        rows, vocab = logits.shape
        out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)]
        if rows:
            _stats_and_gradient_kernel[(rows,)](logits, targets.contiguous(), *out, vocab, IGNORE_INDEX)
        return out[0], out[1], out[2], logits
