"""Linear + cross-entropy in chunks of tokens: per-token losses without ever holding the full float32 logits.

Forward computes, chunk by chunk, the logits in the compute dtype, their float32 log-sum-exp and the target's
logit, and keeps only the log-sum-exp. Backward recomputes each chunk's logits, forms the softmax gradient in
float32 and multiplies it straight into the hidden-state and weight gradients. Peak extra memory is one chunk of
logits (`chunk_size x vocab`), at the cost of one more logits matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.pipeline.runtime.phase import BackwardPhase, current_backward_phase

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
    ) -> torch.Tensor:
        losses = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.zeros_like(losses)
        valid = labels != IGNORE_INDEX
        targets = labels.clamp(min=0)
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            logits = (hidden[start:stop] @ weight.T).float()
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[start:stop, None]).squeeze(1)
            lse[start:stop] = chunk_lse
            losses[start:stop] = torch.where(valid[start:stop], chunk_lse - target_logit, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size = chunk_size
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk_size: int = ctx.chunk_size
        valid = labels != IGNORE_INDEX
        targets = labels.clamp(min=0)
        scale = torch.where(valid, grad_losses.float(), 0.0)
        # Under a pipeline's split backward, only one half is used per pass (see d9d.pipeline's BackwardPhase).
        phase = current_backward_phase()
        want_hidden = ctx.needs_input_grad[0] and phase is not BackwardPhase.WEIGHT
        want_weight = ctx.needs_input_grad[1] and phase is not BackwardPhase.INPUT
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            chunk = hidden[start:stop]
            probs = torch.exp((chunk @ weight.T).float() - lse[start:stop, None])
            rows = torch.arange(stop - start, device=probs.device)
            probs[rows, targets[start:stop]] -= 1.0
            grad_logits = (probs * scale[start:stop, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                # Each chunk's product in the compute dtype (fast tensor-core matmul), summed in float32.
                grad_weight.add_(grad_logits.T @ chunk)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 2048
) -> torch.Tensor:
    """Per-token cross-entropy of `hidden @ weight.T` against `labels`, float32, shaped like `labels`.

    `hidden` is `(..., H)`, `weight` `(V, H)`, `labels` `(...)` with `IGNORE_INDEX` (-100) where no loss is wanted
    (its loss is 0). The caller weights and sums the losses (e.g. divides by the global count of valid tokens).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    shape = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(shape)} disagree on the token count")
    losses = _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, flat_labels, chunk_size)  # type: ignore[no-untyped-call]
    assert isinstance(losses, torch.Tensor)
    return losses.view(shape)
