"""Context-parallel batches: each rank keeps its shard of every sequence, with global positions filled in first.

RoPE positions and document boundaries are facts about the whole row, so `position_ids` (positions within each
document, restarting at 0) are computed before slicing when the batch lacks them; `document_ids` and `labels`
(already shifted) are sliced like the tokens, so the per-token loss and the token count of a shard are right.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9d.core.dist import MeshDegrees
from d9d.core.loop import DataSource
from d9d.parallel.context.layout import check_divisible, shard_sequence

SEQUENCE_KEY = "input_ids"


def positions_within_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """`(rows, seq)` position of each token inside its document (contiguous runs of one id)."""
    rows, seq = document_ids.shape
    index = torch.arange(seq, device=document_ids.device).expand(rows, seq)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def shard_batch_for_context(batch: Mapping[str, Any], rank: int, cp: int) -> dict[str, Any]:
    """This cp rank's part of a dict batch of `(rows, seq, ...)` tensors (`input_ids` fixes `seq`).

    Adds `position_ids` computed on the full rows when absent. Tensors without that sequence dimension (and
    non-tensors) pass through unchanged.
    """
    if SEQUENCE_KEY not in batch:
        raise ValueError(
            f"a context-parallel batch needs '{SEQUENCE_KEY}' to fix the sequence length; got keys {sorted(batch)}"
        )
    tokens = batch[SEQUENCE_KEY]
    rows, seq = tokens.shape[:2]
    check_divisible(seq, cp)
    full = dict(batch)
    if full.get("position_ids") is None:
        documents = full.get("document_ids")
        full["position_ids"] = (
            positions_within_documents(documents)
            if documents is not None
            else torch.arange(seq, device=tokens.device).expand(rows, seq).contiguous()
        )
    return {
        key: shard_sequence(value, rank, cp, dim=1)
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[:2] == (rows, seq)
        else value
        for key, value in full.items()
    }


class ContextParallelDataSource:
    """Wraps a `DataSource` of dict batches (the micro-batches of this data-parallel rank, shared by its cp ranks)
    and hands each cp rank its shard of every micro-batch. The position in the stream is the inner source's."""

    def __init__(self, inner: DataSource[Mapping[str, Any]], *, cp_rank: int, cp: int) -> None:
        self._inner, self._rank, self._cp = inner, cp_rank, cp

    def next_step(self) -> list[dict[str, Any]]:
        return [shard_batch_for_context(batch, self._rank, self._cp) for batch in self._inner.next_step()]

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._inner.load_state_dict(state)


def check_context_parallel(seq_len: int, degrees: MeshDegrees) -> None:
    """Preflight: `seq_len` must split into `2 x cp` equal chunks. Raises ValueError naming the degrees."""
    if degrees.cp == 1:
        return
    try:
        check_divisible(seq_len, degrees.cp)
    except ValueError as error:
        raise ValueError(f"{error} ({degrees.describe()})") from None
