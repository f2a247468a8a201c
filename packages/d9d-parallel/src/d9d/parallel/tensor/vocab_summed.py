"""The vocabulary-parallel loss reduced by a sum, its gradients computed in forward.

The per-token loss already all-reduces each chunk's statistics in forward (`vocab_parallel_cross_entropy`), so once
the chunk's global log-sum-exp is known, its local logits (still at hand) give this rank's `softmax - onehot` slice
at once; the hidden-state gradient (this rank's vocabulary part, summed over the ranks by the gather's backward) and
this rank's weight-row gradient follow from two matmuls. Backward only scales them by the incoming gradient of the
sum, instead of recomputing every chunk's logits (d9d-models' `loss_gradients_in_forward`, design note 0023).
Exact for the sum times any scalar only: the per-token losses are returned detached.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from d9d.parallel.tensor.vocab import IGNORE_INDEX, chunk_lse_and_target, local_shard_inputs, shard_targets


def vocab_parallel_cross_entropy_sum(
    hidden: torch.Tensor, weight: DTensor, labels: torch.Tensor, *, chunk_size: int = 2048
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(loss_sum, losses)` of `hidden @ weight.T` (`weight` split `Shard(0)` over a 1-D mesh, as for
    `vocab_parallel_cross_entropy`): `loss_sum` float32 and differentiable, its gradients computed in forward (only
    for the inputs that need them); `losses` per token, shaped like `labels`, detached. Identical on every rank."""
    shard = local_shard_inputs(hidden, weight, labels, chunk_size)
    grad_enabled = torch.is_grad_enabled()
    total, losses = _SummedVocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        shard.hidden, shard.weight, shard.labels, shard.vocab_start, shard.group, chunk_size,
        grad_enabled and shard.hidden.requires_grad, grad_enabled and shard.weight.requires_grad,
    )  # fmt: skip
    return total, losses.view(labels.shape)


class _SummedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 - autograd.Function.forward takes its inputs positionally
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup,
        chunk_size: int,
        want_input: bool,
        want_weight: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = hidden.shape[0]
        losses = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        valid = labels != IGNORE_INDEX
        local_targets, owned = shard_targets(labels, vocab_start, weight.shape[0])
        grad_hidden = torch.empty_like(hidden) if want_input else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            chunk = hidden[start:stop]
            logits = (chunk @ weight.T).float()
            lse, target = chunk_lse_and_target(logits, local_targets[start:stop], owned[start:stop], group)
            losses[start:stop] = torch.where(valid[start:stop], lse - target, 0.0)
            if grad_hidden is None and grad_weight is None:
                continue
            probs = torch.exp(logits.sub_(lse[:, None]))  # the float32 logits are not needed any more
            rows = torch.arange(stop - start, device=probs.device)
            probs[rows, local_targets[start:stop]] -= owned[start:stop].float()
            grad_logits = (probs * valid[start:stop, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight  # this rank's vocabulary part of the sum
            if grad_weight is not None:
                grad_weight.add_(grad_logits.T @ chunk)  # d9d-kernels' fused float32 add is off limits here
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(losses)
        return losses.sum(), losses

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            None if grad_hidden is None else (grad_hidden * grad_total).to(hidden_dtype),
            None if grad_weight is None else (grad_weight * grad_total).to(weight_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )
