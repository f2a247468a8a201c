"""Tokenize one unit of work into token-shard files; runs in a worker process (spawned, so it imports little)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from d9d.core.data import ShardInfo, TokenDType, TokenShardWriter
from d9d.flows.jobs.data_prep.corpus import DocumentRange, read_range

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_BATCH_DOCUMENTS = 64
_BATCH_BYTES = 1 << 20
_tokenizers: dict[tuple[str, int, int], Tokenizer] = {}


@dataclass(frozen=True, kw_only=True)
class WorkItem:
    """Consecutive document ranges that one worker tokenizes into one train and one validation shard."""

    number: int
    ranges: tuple[DocumentRange, ...]
    validation: frozenset[int]  # numbers of this item's documents that belong to the validation split
    text_field: str
    tokenizer_path: Path
    dtype: TokenDType
    train_path: Path
    validation_path: Path

    @property
    def text_bytes(self) -> int:
        return sum(document_range.text_bytes for document_range in self.ranges)


@dataclass(frozen=True, kw_only=True)
class ItemResult:
    number: int
    train: ShardInfo | None  # None when no document of the item went to this split (no file is written)
    validation: ShardInfo | None
    documents: int
    empty_documents: int
    tokens: int
    text_bytes: int
    seconds: float


def initialize_worker() -> None:
    # One process per core does the parallelism; the tokenizer's own thread pool would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C goes to the parent, which shuts the pool down; workers dying of it would only add tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _tokenizers:
        _tokenizers[key] = Tokenizer.from_file(str(path))
    return _tokenizers[key]


def tokenize_item(item: WorkItem) -> ItemResult:
    started = time.perf_counter()
    tokenizer = _tokenizer(item.tokenizer_path)
    item.train_path.parent.mkdir(parents=True, exist_ok=True)
    item.validation_path.parent.mkdir(parents=True, exist_ok=True)
    writers = {
        False: TokenShardWriter(item.train_path, dtype=item.dtype),
        True: TokenShardWriter(item.validation_path, dtype=item.dtype),
    }
    documents = empty = tokens = text_bytes = 0
    try:
        batch: list[tuple[str, int, bool]] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal tokens
            # encode_batch_fast skips character offsets, which token shards do not keep: about 2x faster.
            encodings = tokenizer.encode_batch_fast([text for text, _, _ in batch])
            for (_, size, is_validation), encoding in zip(batch, encodings, strict=True):
                writers[is_validation].add_document(encoding.ids, num_bytes=size)
                tokens += len(encoding.ids)
            batch.clear()

        for document_range in item.ranges:
            for offset, text in enumerate(read_range(document_range, text_field=item.text_field)):
                documents += 1
                size = len(text.encode("utf-8"))
                text_bytes += size
                if not text:
                    # An empty document carries no tokens and would only add a zero-length entry.
                    empty += 1
                    continue
                batch.append((text, size, document_range.first_document + offset in item.validation))
                batch_bytes += size
                if len(batch) >= _BATCH_DOCUMENTS or batch_bytes >= _BATCH_BYTES:
                    flush()
                    batch_bytes = 0
        if batch:
            flush()
        shards = {split: _close(writer) for split, writer in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return ItemResult(
        number=item.number,
        train=shards[False],
        validation=shards[True],
        documents=documents,
        empty_documents=empty,
        tokens=tokens,
        text_bytes=text_bytes,
        seconds=time.perf_counter() - started,
    )


def _close(writer: TokenShardWriter) -> ShardInfo | None:
    if writer.num_documents == 0:
        writer.abort()
        return None
    return writer.close()
