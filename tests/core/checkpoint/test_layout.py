"""Which checkpoints count (only marked ones) and what retention may delete (never the newest complete one)."""

import json
import random

import numpy as np
import pytest
import torch

from d9d.core.checkpoint import (
    MARKER,
    capture_rng_state,
    checkpoint_dir,
    latest_complete,
    list_checkpoints,
    prune,
    restore_rng_state,
)


def _make(root, step, complete):
    path = checkpoint_dir(root, step)
    path.mkdir(parents=True)
    if complete:
        (path / MARKER).write_text(f"{step}\n")
    return path


def test_latest_complete_ignores_unmarked_and_foreign_folders(tmp_path):
    assert latest_complete(tmp_path / "missing") is None
    _make(tmp_path, 5, True)
    ten = _make(tmp_path, 10, True)
    _make(tmp_path, 15, False)
    (tmp_path / "notes").mkdir()
    assert latest_complete(tmp_path) == ten
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5, 10, 15]


def test_prune_keeps_newest_complete_and_newer_incomplete(tmp_path):
    for step, complete in [(5, True), (7, False), (10, True), (15, True), (20, False)]:
        _make(tmp_path, step, complete)
    removed = prune(tmp_path, keep_last=2)
    assert sorted(path.name for path in removed) == ["step-00000005", "step-00000007"]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 15, 20]


def test_prune_never_deletes_the_only_complete_checkpoint(tmp_path):
    only = _make(tmp_path, 5, True)
    _make(tmp_path, 10, False)
    prune(tmp_path, keep_last=1)
    assert latest_complete(tmp_path) == only
    with pytest.raises(ValueError, match="keep_last=0"):
        prune(tmp_path, keep_last=0)


def test_prune_without_any_complete_checkpoint_deletes_nothing(tmp_path):
    _make(tmp_path, 5, False)
    assert prune(tmp_path, keep_last=1) == []


def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(capture_rng_state()))  # stored as plain JSON: nothing is ever unpickled
    first = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], first[0]) and np.array_equal(again[1], first[1]) and again[2] == first[2]
