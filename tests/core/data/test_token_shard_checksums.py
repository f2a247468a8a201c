"""Token shards carry a CRC-32 of their body (header and index.json): a same-size corruption, one flipped byte
anywhere in the token ids or the document index, is refused at open naming the file and how to rebuild it;
version 1 shards (no checksum) are still read."""

import json
import struct
import zlib

import numpy as np
import pytest

from d9d.core.data import (
    INDEX_FILENAME,
    TokenShardFormatError,
    TokenShardReader,
    TokenShardSet,
    TokenShardSetWriter,
)
from d9d.core.data.token_shards import HEADER_BYTES, body_crc32


def _write_set(directory, *, documents=30, max_shard_tokens=200, seed=0):
    rng = np.random.default_rng(seed)
    with TokenShardSetWriter(directory, dtype="uint16", max_shard_tokens=max_shard_tokens) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(0, 1000, size=int(rng.integers(1, 40))), num_bytes=7)
    return sorted(directory.glob("*.d9dtok"))


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_checksum_is_recorded_in_the_header_and_the_index(tmp_path):
    shards = _write_set(tmp_path)
    index = json.loads((tmp_path / INDEX_FILENAME).read_text())
    assert index["version"] == 2 and len(shards) > 1
    for path, entry in zip(shards, index["shards"], strict=True):
        assert entry["crc32"] == TokenShardReader(path).crc32 == zlib.crc32(path.read_bytes()[HEADER_BYTES:])


@pytest.mark.parametrize("where", ["first token", "last token", "document index"])
def test_a_flipped_byte_is_refused_naming_the_file_and_how_to_rebuild(tmp_path, where):
    shard = _write_set(tmp_path)[1]
    reader = TokenShardReader(shard)
    offsets = {
        "first token": HEADER_BYTES,
        "last token": HEADER_BYTES + 2 * reader.num_tokens - 1,
        "document index": shard.stat().st_size - 3,  # inside the num_bytes array
    }
    del reader
    size = shard.stat().st_size
    _flip(shard, offsets[where])
    assert shard.stat().st_size == size  # same size: the old size-only checks passed this file
    with pytest.raises(TokenShardFormatError, match=rf"{shard.name}: checksum mismatch.*rerun data preparation"):
        TokenShardSet(tmp_path)
    with pytest.raises(TokenShardFormatError, match="checksum mismatch"):
        TokenShardReader(shard)
    TokenShardReader(shard, verify=False)  # the opt-out still opens it (for forensics), unverified


def test_a_valid_shard_swapped_in_behind_the_index_is_refused(tmp_path):
    first, second = _write_set(tmp_path / "a"), _write_set(tmp_path / "b", seed=1)
    second[0].replace(first[0])  # a different, internally consistent shard under the same name
    with pytest.raises(TokenShardFormatError, match=r"shard-00000\.d9dtok: (holds|its header records crc32)"):
        TokenShardSet(tmp_path / "a")


def test_version_1_shards_without_a_checksum_are_still_read(tmp_path):
    shards = _write_set(tmp_path)
    for path in shards:  # rewrite as the version 1 writer did: version 1, reserved bytes zero
        data = bytearray(path.read_bytes())
        struct.pack_into("<I", data, 8, 1)
        struct.pack_into("<I", data, 48, 0)
        path.write_bytes(bytes(data))
    index = json.loads((tmp_path / INDEX_FILENAME).read_text())
    index["version"] = 1
    del index["index_crc32"]  # version 1 indexes had no checksum of their own
    for entry in index["shards"]:
        del entry["crc32"]
    (tmp_path / INDEX_FILENAME).write_text(json.dumps(index))
    opened = TokenShardSet(tmp_path)
    assert opened.index.version == 1 and all(shard.crc32 is None for shard in opened.shards)
    assert opened.num_documents == 30


def test_body_crc32_reads_in_chunks_like_one_pass(tmp_path):
    shard = _write_set(tmp_path, documents=200, max_shard_tokens=10**6)[0]
    assert body_crc32(shard) == zlib.crc32(shard.read_bytes()[HEADER_BYTES:])
