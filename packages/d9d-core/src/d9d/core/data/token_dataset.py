"""Datasets over the token-shard format (`token_shards`): documents, or packed fixed-length rows of them.

Both are map-style and read lazily from the memory-mapped shards, so they work with `DataParallelLoader` (any
order, resumable on any data-parallel size) and with DataLoader workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset

from d9d.core.data.packing import (
    PackedRowPlan,
    PackedSequence,
    PackingMode,
    SplitPackingPlan,
    pack_row,
    plan_packing,
)
from d9d.core.data.token_shards import TokenShardSet


def _open(shards: TokenShardSet | Path | str) -> TokenShardSet:
    return shards if isinstance(shards, TokenShardSet) else TokenShardSet(Path(shards))


class TokenDocumentDataset(Dataset[torch.Tensor]):
    """Each item is one document's token ids (int64), truncated to `max_length` if given."""

    def __init__(self, shards: TokenShardSet | Path | str, *, max_length: int | None = None) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {max_length}")
        self.shards = _open(shards)
        self.max_length = max_length

    def __len__(self) -> int:
        return self.shards.num_documents

    def __getitem__(self, index: int) -> torch.Tensor:
        tokens = self.shards.document(index)[: self.max_length]
        return torch.from_numpy(np.asarray(tokens, dtype=np.int64))

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """Tokens per item (after truncation), for `LengthBucketedOrder`; read from the index, not the tokens."""
        per_shard = [shard.document_lengths() for shard in self.shards.shards]
        lengths = np.concatenate(per_shard).astype(np.int64) if per_shard else np.zeros(0, dtype=np.int64)
        return lengths if self.max_length is None else np.minimum(lengths, self.max_length)


class PackedTokenDataset(Dataset[PackedSequence]):
    """Rows of `seq_len` tokens packed from the set's documents in order (see `packing` for the modes).

    'split' rows are computed per item from cumulative lengths (nothing is planned up front, fit for pretraining
    corpora of any size); 'whole' rows are planned once from the document lengths when the dataset is built.
    """

    def __init__(
        self,
        shards: TokenShardSet | Path | str,
        seq_len: int,
        *,
        mode: PackingMode = "split",
        pad_id: int = 0,
    ) -> None:
        self.documents = TokenDocumentDataset(shards)
        self.seq_len = seq_len
        self.pad_id = pad_id
        lengths = self.documents.lengths
        self.plan: SplitPackingPlan | list[PackedRowPlan]
        match mode:
            case "split":
                self.plan = SplitPackingPlan(lengths, seq_len)
            case "whole":
                self.plan = plan_packing(lengths.tolist(), seq_len, mode="whole")
            case _:
                raise ValueError(f"mode={mode!r} is not a packing mode; valid: 'split', 'whole'")

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> PackedSequence:
        return pack_row(self.plan[index], self.documents.__getitem__, self.seq_len, pad_id=self.pad_id)


def collate_packed(rows: list[PackedSequence]) -> dict[str, Any]:
    """Stack packed rows into `[batch, seq_len]` tensors: input_ids, labels, position_ids, document_ids."""
    return {
        "input_ids": torch.stack([row.input_ids for row in rows]),
        "labels": torch.stack([row.labels for row in rows]),
        "position_ids": torch.stack([row.position_ids for row in rows]),
        "document_ids": torch.stack([row.document_ids for row in rows]),
    }
