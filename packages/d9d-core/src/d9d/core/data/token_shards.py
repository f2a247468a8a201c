"""The memory-mapped token-shard format: tokenized documents on disk, read without loading them into memory.

A *shard set* is a directory with an `index.json` and one or more shard files (`*.d9dtok`). A shard file is
little-endian and laid out so that every array in it can be memory-mapped as it lies:

    offset 0   magic      8 bytes  b"D9DTOKS\\0"
           8   version    uint32   FORMAT_VERSION
          12   dtype      uint32   1 = uint16, 2 = uint32 (the token ids)
          16   documents  uint64   number of documents
          24   tokens     uint64   number of tokens
          32   tokens_at  uint64   byte offset of the token array (HEADER_BYTES)
          40   index_at   uint64   byte offset of the document index (8-byte aligned)
          48   crc32      uint32   zlib.crc32 of every byte after the header (version 2; zero in version 1)
          52   reserved   12 bytes (zero)
    tokens_at  token ids, `tokens` values of `dtype`, documents one after another
    index_at   offsets    int64[documents + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
               num_bytes  int64[documents]: UTF-8 bytes of document i's source text (bits per byte needs it)

The header is written last (the writer streams tokens, keeps the small index in memory, then seeks back), so a
file whose writer died has a zero header and is rejected rather than read as empty. `index.json` repeats each
shard's counts; the reader checks the two agree, so a shard replaced or truncated behind the index's back is an
error, not silently different data. The CRC-32 of the body (header to end) is in the header and in
`index.json`; readers verify it at open, so a same-size corruption (a flipped byte) is refused with the file named
instead of training on wrong token ids. Version 1 shards (no checksum) are still read, unverified.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Self

import numpy as np
import numpy.typing as npt

FORMAT_VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)  # version 1: the same layout without the checksum
FORMAT_NAME: Final = "d9d-token-shards"
SHARD_SUFFIX: Final = ".d9dtok"
INDEX_FILENAME: Final = "index.json"
MAGIC: Final = b"D9DTOKS\x00"
HEADER_BYTES: Final = 64

TokenDType = Literal["uint16", "uint32"]
_DTYPE_CODES: Final[dict[TokenDType, int]] = {"uint16": 1, "uint32": 2}
_HEADER = struct.Struct("<8sIIQQQQI12x")
_CHUNK = 1 << 24  # bytes per zlib.crc32 call when verifying
REBUILD_HINT = (
    "rebuild it: rerun data preparation (`d9d run data-prep`; a shard set that fails this check is written again), "
    "or delete the shard set and rerun"
)
assert _HEADER.size == HEADER_BYTES


class TokenShardFormatError(ValueError):
    """A shard file or shard set does not follow the format (names the file and what is wrong)."""


def token_dtype_for_vocab(vocab_size: int) -> TokenDType:
    """The smallest token dtype that holds every id of a vocabulary of `vocab_size` tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids (at most {2**32})")


def _numpy_dtype(dtype: TokenDType) -> np.dtype[Any]:
    # Explicit little-endian so files are portable between hosts.
    return np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4")


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """What `index.json` records about one shard file (its name is relative to the shard set directory)."""

    file: str
    num_documents: int
    num_tokens: int
    num_bytes: int
    crc32: int | None = None  # of the shard's body (see the module doc); None: a version 1 shard

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "file": self.file,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "num_bytes": self.num_bytes,
        }
        if self.crc32 is not None:
            record["crc32"] = self.crc32
        return record


class TokenShardWriter:
    """Writes one shard file, one document at a time; `close()` (or leaving the `with`) completes it."""

    def __init__(self, path: Path, *, dtype: TokenDType) -> None:
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"token dtype {dtype!r} is not supported; use one of {sorted(_DTYPE_CODES)}")
        self.path = path
        self.dtype: TokenDType = dtype
        self._np_dtype = _numpy_dtype(dtype)
        self._max_id = int(np.iinfo(self._np_dtype).max)
        self._offsets: list[int] = [0]
        self._num_bytes: list[int] = []
        self._file = path.open("wb")
        # A zero header until close(): a half-written file never passes as a valid shard.
        self._file.write(b"\x00" * HEADER_BYTES)
        self._crc32 = 0  # running checksum of the body, as it is written
        self._info: ShardInfo | None = None

    def _write_body(self, data: bytes) -> None:
        self._file.write(data)
        self._crc32 = zlib.crc32(data, self._crc32)

    def add_document(self, tokens: Sequence[int] | npt.NDArray[np.integer[Any]], num_bytes: int) -> None:
        """Append one document: its token ids and the UTF-8 byte length of the text they came from."""
        if self._info is not None:
            raise RuntimeError(f"{self.path} is already closed")
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes} for document {len(self._num_bytes)}")
        ids = np.asarray(tokens)
        if ids.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got shape {ids.shape}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > self._max_id):
            raise ValueError(
                f"token ids of document {len(self._num_bytes)} span [{int(ids.min())}, {int(ids.max())}], "
                f"outside {self.dtype} [0, {self._max_id}]; use a wider dtype (see token_dtype_for_vocab)"
            )
        self._write_body(ids.astype(self._np_dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(ids.size))
        self._num_bytes.append(int(num_bytes))

    @property
    def num_documents(self) -> int:
        return len(self._num_bytes)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def close(self) -> ShardInfo:
        """Write the index and the header; returns the counts `index.json` records (idempotent)."""
        if self._info is not None:
            return self._info
        num_tokens = self._offsets[-1]
        tokens_end = HEADER_BYTES + num_tokens * self._np_dtype.itemsize
        index_at = (tokens_end + 7) // 8 * 8
        self._write_body(b"\x00" * (index_at - tokens_end))
        self._write_body(np.asarray(self._offsets, dtype="<i8").tobytes())
        self._write_body(np.asarray(self._num_bytes, dtype="<i8").tobytes())
        self._file.seek(0)
        self._file.write(
            _HEADER.pack(
                MAGIC,
                FORMAT_VERSION,
                _DTYPE_CODES[self.dtype],
                self.num_documents,
                num_tokens,
                HEADER_BYTES,
                index_at,
                self._crc32,
            )
        )
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._info = ShardInfo(
            file=self.path.name,
            num_documents=self.num_documents,
            num_tokens=num_tokens,
            num_bytes=sum(self._num_bytes),
            crc32=self._crc32,
        )
        return self._info

    def abort(self) -> None:
        """Close and delete a shard that will not be completed."""
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TokenShardReader:
    """One shard file, memory-mapped: token ids, document boundaries and per-document byte lengths.

    `verify`: check the body's CRC-32 against the header at open (one sequential read of the file, about 1 GB/s
    per core; the file's pages are then in the page cache the memory map reads from). Version 1 shards have none.
    """

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        self.path = path
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise TokenShardFormatError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
        with path.open("rb") as handle:
            magic, version, dtype_code, documents, tokens, tokens_at, index_at, crc32 = _HEADER.unpack(
                handle.read(HEADER_BYTES)
            )
        if magic != MAGIC:
            hint = " (all zero: its writer did not finish)" if magic == b"\x00" * 8 else ""
            raise TokenShardFormatError(f"{path}: not a d9d token shard, magic is {magic!r}{hint}")
        if version not in READABLE_VERSIONS:
            raise TokenShardFormatError(
                f"{path}: format version {version} is not supported; this d9d-core reads versions "
                f"{list(READABLE_VERSIONS)}"
            )
        dtypes = {code: name for name, code in _DTYPE_CODES.items()}
        if dtype_code not in dtypes:
            raise TokenShardFormatError(f"{path}: dtype code {dtype_code} is unknown; known codes: {dtypes}")
        self.version: int = version
        self.crc32: int | None = crc32 if version >= 2 else None
        self.dtype: TokenDType = dtypes[dtype_code]
        self.num_documents: int = documents
        self.num_tokens: int = tokens
        np_dtype = _numpy_dtype(self.dtype)
        expected = index_at + (2 * documents + 1) * 8
        if tokens_at != HEADER_BYTES or index_at < tokens_at + tokens * np_dtype.itemsize or size != expected:
            raise TokenShardFormatError(
                f"{path}: {size} bytes, but its header ({documents} documents, {tokens} tokens of {self.dtype}) "
                f"needs {expected}; the file is truncated or was not written by TokenShardWriter; {REBUILD_HINT}"
            )
        if verify and self.crc32 is not None:
            actual = body_crc32(path)
            if actual != self.crc32:
                raise TokenShardFormatError(
                    f"{path}: checksum mismatch (crc32 of its contents is {actual:08x}, its header records "
                    f"{self.crc32:08x}): the file is corrupt; {REBUILD_HINT}"
                )
        # numpy cannot map zero bytes; an empty shard (no tokens) gets a plain empty array instead.
        self.tokens: npt.NDArray[Any] = (
            np.memmap(path, dtype=np_dtype, mode="r", offset=tokens_at, shape=(tokens,))
            if tokens
            else np.zeros(0, dtype=np_dtype)
        )
        index = np.memmap(path, dtype="<i8", mode="r", offset=index_at, shape=(2 * documents + 1,))
        self.document_offsets: npt.NDArray[np.int64] = index[: documents + 1]
        self.document_num_bytes: npt.NDArray[np.int64] = index[documents + 1 :]
        if self.document_offsets[0] != 0 or self.document_offsets[-1] != tokens:
            raise TokenShardFormatError(
                f"{path}: document offsets run from {int(self.document_offsets[0])} to "
                f"{int(self.document_offsets[-1])}, expected 0 to {tokens}"
            )

    def __len__(self) -> int:
        return self.num_documents

    def document(self, index: int) -> npt.NDArray[Any]:
        """Token ids of document `index` (a read-only view into the memory map)."""
        if not -self.num_documents <= index < self.num_documents:
            raise IndexError(f"document {index} out of range for {self.path} with {self.num_documents} documents")
        index %= self.num_documents
        return self.tokens[int(self.document_offsets[index]) : int(self.document_offsets[index + 1])]

    def document_lengths(self) -> npt.NDArray[np.int64]:
        """Tokens per document."""
        return np.diff(self.document_offsets)

    @property
    def num_bytes(self) -> int:
        return int(self.document_num_bytes.sum())


def body_crc32(path: Path) -> int:
    """zlib.crc32 of every byte of shard `path` after its header (what a version 2 header records)."""
    checksum = 0
    with path.open("rb") as handle:
        handle.seek(HEADER_BYTES)
        while chunk := handle.read(_CHUNK):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


@dataclass(frozen=True, kw_only=True)
class TokenShardIndex:
    """The contents of a shard set's `index.json`."""

    dtype: TokenDType
    shards: tuple[ShardInfo, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def num_documents(self) -> int:
        return sum(shard.num_documents for shard in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(shard.num_bytes for shard in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "dtype": self.dtype,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "num_bytes": self.num_bytes,
            "shards": [shard.to_json() for shard in self.shards],
            "metadata": dict(self.metadata),
        }

    def to_json_with_checksum(self) -> dict[str, Any]:
        """`to_json` plus `index_crc32`, the CRC-32 of that content in canonical form, so that a damaged index
        (a changed count or metadata value, not only a changed shard checksum) is refused when read."""
        body = self.to_json()
        return {**body, "index_crc32": _index_crc32(body)}

    @classmethod
    def read(cls, directory: Path) -> TokenShardIndex:
        path = directory / INDEX_FILENAME
        if not path.is_file():
            raise TokenShardFormatError(f"{directory}: no {INDEX_FILENAME}; not a token shard set (or incomplete)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            recorded = raw.pop("index_crc32", None)
            if recorded is not None and int(recorded) != _index_crc32(raw):
                raise TokenShardFormatError(
                    f"{path}: checksum mismatch (the index records crc32 {int(recorded):08x} of its content, which is "
                    f"{_index_crc32(raw):08x}): the index is corrupt; {REBUILD_HINT}"
                )
            if raw.get("format") != FORMAT_NAME:
                raise TokenShardFormatError(f"{path}: format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
            if raw.get("version") not in READABLE_VERSIONS:
                raise TokenShardFormatError(
                    f"{path}: format version {raw.get('version')} is not supported; this d9d-core reads "
                    f"versions {list(READABLE_VERSIONS)}"
                )
            if raw.get("dtype") not in _DTYPE_CODES:
                raise TokenShardFormatError(f"{path}: dtype {raw.get('dtype')!r}; known: {sorted(_DTYPE_CODES)}")
            shards = tuple(
                ShardInfo(
                    file=str(entry["file"]),
                    num_documents=int(entry["num_documents"]),
                    num_tokens=int(entry["num_tokens"]),
                    num_bytes=int(entry["num_bytes"]),
                    crc32=int(entry["crc32"]) if entry.get("crc32") is not None else None,
                )
                for entry in raw["shards"]
            )
            index = cls(
                dtype=raw["dtype"], shards=shards, metadata=dict(raw.get("metadata", {})), version=int(raw["version"])
            )
            totals = {
                "num_documents": index.num_documents,
                "num_tokens": index.num_tokens,
                "num_bytes": index.num_bytes,
            }
            for name, total in totals.items():
                if name in raw and int(raw[name]) != total:
                    raise TokenShardFormatError(
                        f"{path}: {name} is {raw[name]} but its shards sum to {total}: the index is corrupt; "
                        f"{REBUILD_HINT}"
                    )
            return index
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            if isinstance(error, TokenShardFormatError):
                raise
            raise TokenShardFormatError(f"{path}: malformed index ({error!r})") from error


def _index_crc32(body: Mapping[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def write_token_shard_index(
    directory: Path, shards: Sequence[ShardInfo], *, dtype: TokenDType, metadata: Mapping[str, Any] | None = None
) -> TokenShardIndex:
    """Write `index.json` for shard files already in `directory` (written atomically, last)."""
    # A version 1 index if any shard lacks a checksum (shards written by an older writer), else the current one.
    version = FORMAT_VERSION if all(shard.crc32 is not None for shard in shards) else 1
    index = TokenShardIndex(dtype=dtype, shards=tuple(shards), metadata=dict(metadata or {}), version=version)
    names = [shard.file for shard in index.shards]
    if len(set(names)) != len(names):
        raise ValueError(f"shard file names repeat in {names}")
    for name in names:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"shard {name} listed for the index of {directory} does not exist")
    staging = directory / f".{INDEX_FILENAME}.tmp"
    with staging.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(index.to_json_with_checksum(), indent=2) + "\n")
        handle.flush()
        os.fsync(handle.fileno())  # durable before the rename makes it the index (the shards fsync on close)
    staging.replace(directory / INDEX_FILENAME)
    return index


class TokenShardSetWriter:
    """Writes a shard set: documents go to `shard-NNNNN.d9dtok` files of about `max_shard_tokens` tokens each."""

    def __init__(
        self,
        directory: Path,
        *,
        dtype: TokenDType,
        max_shard_tokens: int = 1 << 26,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if max_shard_tokens < 1:
            raise ValueError(f"max_shard_tokens must be positive, got {max_shard_tokens}")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.dtype: TokenDType = dtype
        self.max_shard_tokens = max_shard_tokens
        self.metadata = dict(metadata or {})
        self._shards: list[ShardInfo] = []
        self._current: TokenShardWriter | None = None

    def add_document(self, tokens: Sequence[int] | npt.NDArray[np.integer[Any]], num_bytes: int) -> None:
        if self._current is None:
            self._current = TokenShardWriter(
                self.directory / f"shard-{len(self._shards):05d}{SHARD_SUFFIX}", dtype=self.dtype
            )
        self._current.add_document(tokens, num_bytes)
        if self._current.num_tokens >= self.max_shard_tokens:
            self._shards.append(self._current.close())
            self._current = None

    def close(self) -> TokenShardIndex:
        if self._current is not None:
            self._shards.append(self._current.close())
            self._current = None
        return write_token_shard_index(self.directory, self._shards, dtype=self.dtype, metadata=self.metadata)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._current is not None:
            self._current.abort()


class TokenShardSet:
    """A shard set opened for reading: every shard memory-mapped, documents numbered across shards in index order.

    `verify`: check each shard's CRC-32 at open (see `TokenShardReader`) and against `index.json`.
    """

    def __init__(self, directory: Path, *, verify: bool = True) -> None:
        self.directory = directory
        self.verify = verify
        self.index = TokenShardIndex.read(directory)
        self.shards: tuple[TokenShardReader, ...] = tuple(self._open(info) for info in self.index.shards)
        self._first_document = np.cumsum([0] + [shard.num_documents for shard in self.shards], dtype=np.int64)

    def _open(self, info: ShardInfo) -> TokenShardReader:
        path = self.directory / info.file
        if not path.is_file():
            raise TokenShardFormatError(
                f"{self.directory}: shard {info.file} is listed in the index but missing; {REBUILD_HINT}"
            )
        reader = TokenShardReader(path, verify=self.verify)
        if reader.dtype != self.index.dtype:
            raise TokenShardFormatError(f"{path}: dtype {reader.dtype}, but the index says {self.index.dtype}")
        counts = (reader.num_documents, reader.num_tokens, reader.num_bytes)
        if counts != (info.num_documents, info.num_tokens, info.num_bytes):
            raise TokenShardFormatError(
                f"{path}: holds {counts} (documents, tokens, bytes) but the index records "
                f"{(info.num_documents, info.num_tokens, info.num_bytes)}; the shard was replaced or is damaged; "
                f"{REBUILD_HINT}"
            )
        if info.crc32 is not None and reader.crc32 != info.crc32:
            raise TokenShardFormatError(
                f"{path}: its header records crc32 {reader.crc32}, the index {info.crc32}; the shard was replaced or "
                f"is damaged; {REBUILD_HINT}"
            )
        return reader

    @property
    def dtype(self) -> TokenDType:
        return self.index.dtype

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.index.metadata

    @property
    def num_documents(self) -> int:
        return self.index.num_documents

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    @property
    def num_bytes(self) -> int:
        return self.index.num_bytes

    def __len__(self) -> int:
        return self.num_documents

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, document number inside that shard) of document `index` of the set."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range for {self.directory} with {self.num_documents} documents")
        shard = int(np.searchsorted(self._first_document, index, side="right")) - 1
        return shard, index - int(self._first_document[shard])

    def document(self, index: int) -> npt.NDArray[Any]:
        shard, local = self.locate(index)
        return self.shards[shard].document(local)

    def documents(self) -> Iterator[npt.NDArray[Any]]:
        for shard in self.shards:
            for local in range(shard.num_documents):
                yield shard.document(local)

    def require_metadata(self, key: str, expected: Any, *, what: str) -> None:
        """Fail with a clear message when the set was written with a different `key` (e.g. another tokenizer)."""
        found = self.metadata.get(key)
        if found != expected:
            raise TokenShardFormatError(
                f"{what} mismatch with the token shard set at {self.directory}: it records {key}={found!r}, "
                f"expected {expected!r}; re-run data preparation with this {what}, or use the matching one"
            )
