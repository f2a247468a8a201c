"""The token-shard format: round trips, document boundaries, byte lengths, and rejection of damaged files."""

import json

import numpy as np
import pytest

from d9d.core.data import (
    FORMAT_VERSION,
    INDEX_FILENAME,
    TokenShardFormatError,
    TokenShardReader,
    TokenShardSet,
    TokenShardSetWriter,
    TokenShardWriter,
    token_dtype_for_vocab,
    write_token_shard_index,
)


def _documents(seed: int, count: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 50))) for _ in range(count)]


@pytest.mark.parametrize(("dtype", "high"), [("uint16", 2**16), ("uint32", 2**32)])
def test_shard_round_trips_tokens_boundaries_and_byte_lengths(tmp_path, dtype, high):
    documents = _documents(0, 25, high)
    path = tmp_path / "a.d9dtok"
    with TokenShardWriter(path, dtype=dtype) as writer:
        for number, tokens in enumerate(documents):
            writer.add_document(tokens, num_bytes=3 * number + 1)
    reader = TokenShardReader(path)
    assert (reader.version, reader.dtype, len(reader)) == (FORMAT_VERSION, dtype, 25)
    assert reader.num_tokens == sum(len(d) for d in documents)
    for number, tokens in enumerate(documents):
        np.testing.assert_array_equal(reader.document(number), tokens)
        assert reader.document_num_bytes[number] == 3 * number + 1
    np.testing.assert_array_equal(reader.document_lengths(), [len(d) for d in documents])
    assert reader.num_bytes == sum(3 * n + 1 for n in range(25))
    assert isinstance(reader.tokens, np.memmap)


def test_empty_shard_and_empty_documents_are_valid(tmp_path):
    with TokenShardWriter(tmp_path / "empty.d9dtok", dtype="uint16"):
        pass
    assert len(TokenShardReader(tmp_path / "empty.d9dtok")) == 0
    with TokenShardWriter(tmp_path / "blank.d9dtok", dtype="uint16") as writer:
        writer.add_document([], num_bytes=0)
    reader = TokenShardReader(tmp_path / "blank.d9dtok")
    assert len(reader) == 1
    assert reader.document(0).size == 0


def test_writer_rejects_ids_outside_the_dtype(tmp_path):
    writer = TokenShardWriter(tmp_path / "a.d9dtok", dtype="uint16")
    with pytest.raises(ValueError, match=r"outside uint16 \[0, 65535\]"):
        writer.add_document([1, 70000], num_bytes=5)
    writer.abort()
    assert not (tmp_path / "a.d9dtok").exists()


def test_dtype_follows_vocabulary_size():
    assert token_dtype_for_vocab(50_000) == "uint16"
    assert token_dtype_for_vocab(2**16) == "uint16"
    assert token_dtype_for_vocab(151_936) == "uint32"


def test_unfinished_shard_is_rejected(tmp_path):
    path = tmp_path / "a.d9dtok"
    writer = TokenShardWriter(path, dtype="uint16")
    writer.add_document([1, 2, 3], num_bytes=3)
    writer._file.flush()  # the writer dies here: no index, zero header
    with pytest.raises(TokenShardFormatError, match="writer did not finish"):
        TokenShardReader(path)
    writer.abort()


def test_truncated_shard_is_rejected(tmp_path):
    path = tmp_path / "a.d9dtok"
    with TokenShardWriter(path, dtype="uint16") as writer:
        writer.add_document(list(range(100)), num_bytes=100)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(TokenShardFormatError, match="truncated"):
        TokenShardReader(path)


def test_newer_format_version_is_rejected_with_both_versions(tmp_path):
    path = tmp_path / "a.d9dtok"
    with TokenShardWriter(path, dtype="uint16") as writer:
        writer.add_document([1], num_bytes=1)
    data = bytearray(path.read_bytes())
    data[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(TokenShardFormatError, match=f"version {FORMAT_VERSION + 1} is not supported.*{FORMAT_VERSION}"):
        TokenShardReader(path)


def test_shard_set_numbers_documents_across_shards(tmp_path):
    documents = _documents(1, 40, 1000)
    with TokenShardSetWriter(tmp_path, dtype="uint16", max_shard_tokens=100, metadata={"tokenizer": "abc"}) as w:
        for tokens in documents:
            w.add_document(tokens, num_bytes=len(tokens) * 4)
    shard_set = TokenShardSet(tmp_path)
    assert len(shard_set.shards) > 3
    assert len(shard_set) == 40
    assert shard_set.num_tokens == sum(len(d) for d in documents)
    assert shard_set.num_bytes == 4 * shard_set.num_tokens
    for number, tokens in enumerate(documents):
        np.testing.assert_array_equal(shard_set.document(number), tokens)
    assert [len(d) for d in shard_set.documents()] == [len(d) for d in documents]
    assert shard_set.metadata["tokenizer"] == "abc"
    shard_set.require_metadata("tokenizer", "abc", what="tokenizer")
    with pytest.raises(TokenShardFormatError, match=r"tokenizer mismatch .* tokenizer='abc', expected 'xyz'"):
        shard_set.require_metadata("tokenizer", "xyz", what="tokenizer")


def test_shard_set_detects_a_shard_swapped_behind_the_index(tmp_path):
    with TokenShardSetWriter(tmp_path, dtype="uint16", max_shard_tokens=10) as writer:
        for _ in range(3):
            writer.add_document(list(range(10)), num_bytes=10)
    with TokenShardWriter(tmp_path / "shard-00001.d9dtok", dtype="uint16") as writer:
        writer.add_document(list(range(9)), num_bytes=9)
    with pytest.raises(TokenShardFormatError, match="replaced or is damaged"):
        TokenShardSet(tmp_path)


def test_shard_set_detects_missing_shard_and_missing_index(tmp_path):
    with pytest.raises(TokenShardFormatError, match=r"no index\.json"):
        TokenShardSet(tmp_path)
    with TokenShardSetWriter(tmp_path, dtype="uint16", max_shard_tokens=10) as writer:
        writer.add_document(list(range(10)), num_bytes=10)
    (tmp_path / "shard-00000.d9dtok").unlink()
    with pytest.raises(TokenShardFormatError, match="listed in the index but missing"):
        TokenShardSet(tmp_path)


def test_index_written_from_separately_written_shards(tmp_path):
    infos = []
    for number in range(2):
        with TokenShardWriter(tmp_path / f"part-{number}.d9dtok", dtype="uint16") as writer:
            writer.add_document([number] * 5, num_bytes=7)
        infos.append(writer.close())
    index = write_token_shard_index(tmp_path, infos, dtype="uint16", metadata={"split": "train"})
    assert (index.num_documents, index.num_tokens, index.num_bytes) == (2, 10, 14)
    raw = json.loads((tmp_path / INDEX_FILENAME).read_text())
    assert raw["version"] == FORMAT_VERSION
    assert raw["dtype"] == "uint16"
    np.testing.assert_array_equal(TokenShardSet(tmp_path).document(1), [1] * 5)
