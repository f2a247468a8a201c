"""Sequence packing: several documents per fixed-length row, with what attention needs to keep them apart.

`plan_packing` decides from document lengths alone which token ranges go into which row, so a dataset can pack
lazily and deterministically. `pack_row` builds a row: token ids; position ids counting from 0 at each document's
start (a document continued from the previous row keeps counting); document ids (-1 on padding); next-token labels
that never cross a document boundary; and, on request, a block-diagonal causal attention mask or the cumulative
sequence lengths that varlen attention kernels take.

Modes: 'split' concatenates documents and cuts rows of exactly `seq_len` tokens, so a document may continue in the
next row (no padding except in the last row); 'whole' starts a new row when the next document does not fit and
cuts only documents longer than `seq_len` (no document is split across rows unless it must be).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

PackingMode = Literal["split", "whole"]
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Segment:
    """Tokens `[start, stop)` of document `document`."""

    document: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


PackedRowPlan = tuple[Segment, ...]


def plan_packing(lengths: Sequence[int], seq_len: int, *, mode: PackingMode = "split") -> list[PackedRowPlan]:
    """Rows of at most `seq_len` tokens covering every token of every document, in document order."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if mode not in ("split", "whole"):
        raise ValueError(f"mode={mode!r} is not a packing mode; valid: 'split', 'whole'")
    rows: list[PackedRowPlan] = []
    current: list[Segment] = []
    used = 0
    for document, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"document {document} has a negative length {length}")
        if mode == "whole" and used and used + min(length, seq_len) > seq_len:
            rows.append(tuple(current))
            current, used = [], 0
        start = 0
        while start < length:
            take = min(length - start, seq_len - used)
            current.append(Segment(document, start, start + take))
            start += take
            used += take
            if used == seq_len:
                rows.append(tuple(current))
                current, used = [], 0
    if current:
        rows.append(tuple(current))
    return rows


@dataclass(frozen=True)
class PackedSequence:
    """One packed row of `seq_len` positions (1-D tensors; a collate stacks them)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    def attention_mask(self) -> torch.Tensor:
        """`[seq_len, seq_len]` bool: position i may attend to j iff same document and j <= i (no padding)."""
        return block_causal_mask(self.document_ids)

    def cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of the row's documents (padding excluded), as varlen attention kernels take them."""
        return cumulative_lengths(self.document_ids)


def pack_row(
    plan: PackedRowPlan,
    document: Callable[[int], torch.Tensor],
    seq_len: int,
    *,
    pad_id: int = 0,
) -> PackedSequence:
    """Assemble a planned row; `document(i)` returns document i's token ids (1-D integer tensor)."""
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    document_ids = torch.full((seq_len,), -1, dtype=torch.long)
    offset = 0
    for segment in plan:
        tokens = document(segment.document)[segment.start : segment.stop]
        stop = offset + segment.length
        input_ids[offset:stop] = tokens.to(torch.long)
        position_ids[offset:stop] = torch.arange(segment.start, segment.stop)
        document_ids[offset:stop] = segment.document
        offset = stop
    if offset > seq_len:
        raise ValueError(f"the planned row holds {offset} tokens, more than seq_len={seq_len}")
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    same_document = (document_ids[1:] == document_ids[:-1]) & (document_ids[1:] >= 0)
    labels[:-1] = torch.where(same_document, input_ids[1:], IGNORE_INDEX)
    return PackedSequence(input_ids, labels, position_ids, document_ids)


def pack_documents(
    documents: Sequence[torch.Tensor], seq_len: int, *, mode: PackingMode = "split", pad_id: int = 0
) -> list[PackedSequence]:
    """Pack in-memory documents (e.g. a fine-tuning set) into rows."""
    plans = plan_packing([len(tokens) for tokens in documents], seq_len, mode=mode)
    return [pack_row(plan, documents.__getitem__, seq_len, pad_id=pad_id) for plan in plans]


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within each document; padding (-1) attends to nothing and is attended by nothing.

    Works on `[seq]` or batched `[batch, seq]` document ids; returns `[..., seq, seq]` bool (True = may attend),
    the form `scaled_dot_product_attention(attn_mask=...)` takes.
    """
    seq = document_ids.shape[-1]
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    real = (document_ids >= 0).unsqueeze(-1)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return same & real & causal


def cumulative_lengths(document_ids: torch.Tensor) -> torch.Tensor:
    """`[0, end of first document, ..., end of last document]` (int32) for a 1-D row; padding is excluded."""
    if document_ids.dim() != 1:
        raise ValueError(f"cu_seqlens is per row: expected 1-D document ids, got shape {list(document_ids.shape)}")
    real = document_ids[document_ids >= 0]
    if real.numel() == 0:
        return torch.zeros(1, dtype=torch.int32)
    starts = torch.ones_like(real, dtype=torch.bool)
    starts[1:] = real[1:] != real[:-1]
    boundaries = [*torch.nonzero(starts).flatten().tolist(), real.numel()]
    return torch.tensor(boundaries, dtype=torch.int32)


class SplitPackingPlan:
    """The 'split' plan computed per row from cumulative document lengths: O(documents) memory, not O(segments).

    Row i is tokens `[i * seq_len, (i + 1) * seq_len)` of the concatenated documents; it equals
    `plan_packing(lengths, seq_len, mode='split')[i]`.
    """

    def __init__(self, lengths: Sequence[int] | npt.NDArray[np.int64], seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        self.seq_len = seq_len
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)

    def __len__(self) -> int:
        return (int(self.offsets[-1]) + self.seq_len - 1) // self.seq_len

    def __getitem__(self, row: int) -> PackedRowPlan:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for {len(self)} packed rows")
        start = row * self.seq_len
        stop = min(start + self.seq_len, int(self.offsets[-1]))
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        last = int(np.searchsorted(self.offsets, stop - 1, side="right")) - 1
        segments = []
        for document in range(first, last + 1):
            begin, end = int(self.offsets[document]), int(self.offsets[document + 1])
            if end > begin:
                segments.append(Segment(document, max(start, begin) - begin, min(stop, end) - begin))
        return tuple(segments)
