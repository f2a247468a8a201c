"""Per-forward inputs shared by every layer: positions (reset per packed document) and the attention mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import register_dataclass as register_pytree_dataclass

from d9d.kernels.attention import AttentionMask


@dataclass(frozen=True)
class CausalLMOutput:
    """What a (stage of a) causal LM returns: `hidden_states` on every stage but the last; on the last, `losses`
    (per token, float32) and `loss_sum` (their sum) when labels were given, else `logits`.

    Train through `loss_sum` (times any scalar): it is the differentiable loss whichever way the model computes its
    gradients. With `DecoderConfig.loss_gradients_in_forward` the gradients of the sum are computed in forward and
    `losses` are detached (for metrics only)."""

    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    losses: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None


# FSDP2 finds a unit's outputs with pytree flattening to hook its pre-backward all-gather on them; torch 2.11 does
# not look inside unregistered dataclasses, so without this the root unit's parameters stay freed in backward
# (segfault on CPU, illegal memory access on CUDA).
register_pytree_dataclass(CausalLMOutput)


def positions_within_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document: `(batch, seq)`, restarting at 0 where the id changes."""
    batch, seq = document_ids.shape
    index = torch.arange(seq, device=document_ids.device).expand(batch, seq)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_index = torch.where(starts, index, 0).cummax(dim=1).values
    return index - start_index


def resolve_positions(
    batch: int, seq: int, device: torch.device, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None
) -> torch.Tensor:
    """`position_ids` if given, else positions within documents, else `0..seq-1` for each row."""
    if position_ids is not None:
        return position_ids
    if document_ids is not None:
        return positions_within_documents(document_ids)
    return torch.arange(seq, device=device).expand(batch, seq)


def causal_mask(document_ids: torch.Tensor | None) -> AttentionMask:
    return AttentionMask(causal=True, document_ids=document_ids)
