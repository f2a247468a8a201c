"""The chunk driver shared by the eager and the Triton fused linear + cross-entropy.

Tokens go through in chunks of `chunk_size`: a chunk's logits `(chunk, vocab_shard)` are one matmul in the compute
dtype, reduced at once to three float32 numbers per token (`LogitStats`: max, sum of `exp(logit - max)`, the
target's logit if the target lies in this shard, else 0) and dropped. Backward recomputes each chunk's logits, turns
them into `(softmax - onehot) * grad_loss` in the compute dtype and multiplies that into the hidden-state gradient
(`@ weight`) and the weight gradient (`.T @ hidden`, summed over chunks in float32). `ChunkMath` supplies the two
per-chunk steps (PyTorch ops or Triton kernels); everything else is here, so both backends agree by construction.

With the loss *summed* (`logit_stats_and_gradients`), every token's incoming gradient is the same scalar, so the
gradients can be formed in forward from the one logits matmul per chunk: the stats and `softmax - onehot` come from
one pass over the chunk (`ChunkMath.stats_and_gradient`), then the two gradient matmuls run at once, and backward
only scales the saved gradients by the scalar (design note 0023).

A vocabulary-parallel head calls the pieces per shard: `logit_stats` with its `vocab_start`, an all-reduce of the
stats over the tensor-parallel group (`combine_logit_stats` is the single-process version: max of maxima, rescaled
sum, sum of target logits), then `logit_gradients` with the global log-sum-exp; the hidden-state gradients of the
shards sum to the full one, and each shard's weight gradient is its slice of the full one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from d9d.kernels.linear_cross_entropy.accumulate import addmm_float32_

IGNORE_INDEX = -100


def flatten_tokens(hidden: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden` `(..., H)` and `labels` `(...)` as `(N, H)` and `(N,)`, checked."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token count")
    return flat_hidden, flat_labels


@dataclass(frozen=True)
class LogitStats:
    """Per-token float32 statistics of one vocabulary shard's logits."""

    max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor

    def logsumexp(self) -> torch.Tensor:
        return self.max + torch.log(self.sum_exp)


class ChunkMath(Protocol):
    def stats(
        self, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(max, sum_exp, target_logit)` of `logits` `(rows, vocab_shard)`, float32 `(rows,)` each."""
        ...

    def gradient(
        self, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int
    ) -> torch.Tensor:
        """`(exp(logits - lse) - onehot(targets)) * scale` in `logits`' dtype (may overwrite `logits`)."""
        ...

    def stats_and_gradient(
        self, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(max, sum_exp, target_logit, grad_logits)` of a whole-vocabulary chunk: the stats as `stats`, and
        `softmax - onehot(targets)` (0 on rows whose target is `IGNORE_INDEX`) in `logits`' dtype (may overwrite
        `logits`)."""
        ...


def logit_stats(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, chunk_size: int,
    math: ChunkMath,
) -> LogitStats:  # fmt: skip
    """Statistics of `hidden @ weight.T` (`hidden` `(N, H)`, `weight` `(V_shard, H)`) for the targets `(N,)`."""
    tokens = hidden.shape[0]
    out = [torch.empty(tokens, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    for start in range(0, tokens, chunk_size):
        stop = min(start + chunk_size, tokens)
        logits = hidden[start:stop] @ weight.T
        for target, value in zip(out, math.stats(logits, targets[start:stop], vocab_start), strict=True):
            target[start:stop] = value
    return LogitStats(max=out[0], sum_exp=out[1], target_logit=out[2])


def logit_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_losses: torch.Tensor,
    *, vocab_start: int, chunk_size: int, math: ChunkMath, want_input: bool = True, want_weight: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """`(grad_hidden, grad_weight)` of the per-token losses for `grad_losses` (each `None` when not wanted).

    `lse` is the log-sum-exp over the whole vocabulary (all shards); tokens whose target is `IGNORE_INDEX` get no
    gradient. `grad_weight` is float32 (the caller casts it)."""
    scale = torch.where(targets != IGNORE_INDEX, grad_losses.float(), 0.0)
    grad_hidden = torch.empty_like(hidden) if want_input else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
    for start in range(0, hidden.shape[0], chunk_size):
        stop = min(start + chunk_size, hidden.shape[0])
        chunk = hidden[start:stop]
        grad_logits = math.gradient(
            chunk @ weight.T, targets[start:stop], lse[start:stop], scale[start:stop], vocab_start
        )
        if grad_hidden is not None:
            grad_hidden[start:stop] = grad_logits @ weight
        if grad_weight is not None:
            # Each chunk's tensor-core matmul, summed over chunks in float32 (inside the matmul where supported).
            addmm_float32_(grad_weight, grad_logits.T, chunk)
    return grad_hidden, grad_weight


@dataclass(frozen=True)
class StatsAndGradients:
    """What the forward of a summed loss computes: the stats, and the gradients of the loss *sum* (each `None`
    when not wanted; `grad_weight` float32)."""

    stats: LogitStats
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None


def logit_stats_and_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int, math: ChunkMath,
    want_input: bool, want_weight: bool,
) -> StatsAndGradients:  # fmt: skip
    """Stats of `hidden @ weight.T` over the whole vocabulary (`weight` `(V, H)`) and the gradients of the sum of
    the per-token losses, one logits matmul per chunk. Tokens whose target is `IGNORE_INDEX` get no gradient."""
    tokens = hidden.shape[0]
    out = [torch.empty(tokens, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    grad_hidden = torch.empty_like(hidden) if want_input else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
    for start in range(0, tokens, chunk_size):
        stop = min(start + chunk_size, tokens)
        chunk = hidden[start:stop]
        *stats, grad_logits = math.stats_and_gradient(chunk @ weight.T, targets[start:stop])
        for target, value in zip(out, stats, strict=True):
            target[start:stop] = value
        if grad_hidden is not None:
            torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        if grad_weight is not None:
            addmm_float32_(grad_weight, grad_logits.T, chunk)
    stats_out = LogitStats(max=out[0], sum_exp=out[1], target_logit=out[2])
    return StatsAndGradients(stats=stats_out, grad_hidden=grad_hidden, grad_weight=grad_weight)


def combine_logit_stats(shards: Sequence[LogitStats]) -> LogitStats:
    """The statistics of the whole vocabulary from its shards' (what an all-reduce over tensor parallelism does:
    MAX of the maxima, SUM of the rescaled sums and of the target logits)."""
    maximum = torch.stack([shard.max for shard in shards]).amax(dim=0)
    sum_exp = sum((shard.sum_exp * torch.exp(shard.max - maximum) for shard in shards), torch.zeros_like(maximum))
    target = sum((shard.target_logit for shard in shards), torch.zeros_like(maximum))
    return LogitStats(max=maximum, sum_exp=sum_exp, target_logit=target)


def losses_from_stats(stats: LogitStats, targets: torch.Tensor) -> torch.Tensor:
    """Per-token losses `lse - target_logit` (0 where the target is `IGNORE_INDEX`)."""
    return torch.where(targets != IGNORE_INDEX, stats.logsumexp() - stats.target_logit, 0.0)
