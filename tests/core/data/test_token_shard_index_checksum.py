"""`index.json` checks itself: a changed digit anywhere in it (a count, a metadata value) is refused when the shard
set is opened, naming the file and how to rebuild it, as the fault campaign's `flip-index` fault requires."""

import json
from pathlib import Path

import numpy as np
import pytest

from d9d.core.data import TokenShardSetWriter
from d9d.core.data.token_shards import INDEX_FILENAME, TokenShardFormatError, TokenShardIndex


def _shard_set(directory: Path) -> Path:
    with TokenShardSetWriter(directory, dtype="uint16", metadata={"vocab_size": 512, "seed": 7}) as writer:
        for length in (5, 9, 3):
            writer.add_document(np.arange(length, dtype=np.uint16), num_bytes=length * 4)
    return directory


def test_an_untouched_index_reads(tmp_path):
    index = TokenShardIndex.read(_shard_set(tmp_path / "set"))
    assert index.num_tokens == 17 and index.metadata["seed"] == 7


@pytest.mark.parametrize("key", ["num_tokens", "seed"])
def test_a_changed_value_is_refused_naming_the_index(tmp_path, key):
    directory = _shard_set(tmp_path / "set")
    path = directory / INDEX_FILENAME
    raw = json.loads(path.read_text())
    if key == "seed":
        raw["metadata"]["seed"] = 8
    else:
        raw[key] += 1
    path.write_text(json.dumps(raw, indent=2))
    with pytest.raises(TokenShardFormatError, match=r"index\.json: checksum mismatch"):
        TokenShardIndex.read(directory)


def test_totals_are_checked_against_the_shards_without_a_checksum(tmp_path):
    directory = _shard_set(tmp_path / "set")
    path = directory / INDEX_FILENAME
    raw = json.loads(path.read_text())
    del raw["index_crc32"]  # an index written before the checksum existed
    raw["num_documents"] += 1
    path.write_text(json.dumps(raw, indent=2))
    with pytest.raises(TokenShardFormatError, match="num_documents is 4 but its shards sum to 3"):
        TokenShardIndex.read(directory)
