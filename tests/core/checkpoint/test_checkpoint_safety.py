"""Job checkpoints never unpickle the RNG or loop state, are owner-only, survive a torn newest checkpoint by
falling back to the previous complete one, and fsync every file and directory before the completion marker."""

import builtins
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

from d9d.core.checkpoint import (
    MARKER,
    JobCheckpointer,
    ModelAndOptimizer,
    RngStateError,
    legacy_rng_file,
    rng_file,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process on purpose


class _Plant:
    """Unpickling this creates `marker`: proof that a file was unpickled (i.e. code ran)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


def _malicious_pickle(marker: Path) -> bytes:
    payload = pickle.dumps(_Plant(marker))
    pickle.loads(payload).close()  # the plant is live: unpickling it does create the marker ...
    assert marker.exists()
    marker.unlink()  # ... which the loads below must never do
    return payload


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root: Path, step: int, seed: int) -> Path:
    model, optimizer = _model_and_optimizer(seed)
    return JobCheckpointer(root, keep_last=3, rank=0).save(step, {"app": ModelAndOptimizer(model, optimizer)})


def test_a_pickle_planted_as_rng_state_is_refused_never_executed(tmp_path):
    path = _save(tmp_path / "ckpt", 1, seed=0)
    marker = tmp_path / "pwned"
    rng_file(path, 0).write_bytes(_malicious_pickle(marker))
    model, optimizer = _model_and_optimizer(1)
    with pytest.raises(RngStateError, match=r"rank-00000\.json is not JSON RNG state"):
        JobCheckpointer(path.parent, keep_last=3, rank=0).load(path, {"app": ModelAndOptimizer(model, optimizer)})
    assert not marker.exists()


def test_a_legacy_pickled_rng_file_is_refused_with_what_to_do(tmp_path):
    path = _save(tmp_path / "ckpt", 1, seed=0)
    marker = tmp_path / "pwned"
    rng_file(path, 0).unlink()
    torch.save(_Plant(marker), legacy_rng_file(path, 0))  # how the old format stored it: torch.save's pickle
    marker.unlink(missing_ok=True)
    model, optimizer = _model_and_optimizer(1)
    with pytest.raises(RngStateError, match=r"no longer unpickles.*delete .*rng"):
        JobCheckpointer(path.parent, keep_last=3, rank=0).load(path, {"app": ModelAndOptimizer(model, optimizer)})
    assert not marker.exists()
    shutil.rmtree(path / "rng")  # the documented way out: the rest still resumes
    JobCheckpointer(path.parent, keep_last=3, rank=0).load(path, {"app": ModelAndOptimizer(model, optimizer)})
    assert torch.equal(model.weight, _model_and_optimizer(0)[0].weight)


def test_checkpoint_folders_are_owner_only(tmp_path):
    path = _save(tmp_path / "ckpt", 1, seed=0)
    for folder in (tmp_path / "ckpt", path, path / "rng"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_rewriting_a_step_removes_its_stale_marker_and_files_first(tmp_path):
    root = tmp_path / "ckpt"
    path = _save(root, 5, seed=0)
    (path / "__7_0.distcp").write_bytes(b"left by another world size")
    model, optimizer = _model_and_optimizer(1)
    seen = {}

    def before_marker(folder: Path) -> None:
        seen["marker"] = (folder / MARKER).exists()
        seen["stale"] = (folder / "__7_0.distcp").exists()

    JobCheckpointer(root, keep_last=3, rank=0).save(
        5, {"app": ModelAndOptimizer(model, optimizer)}, before_marker=before_marker
    )
    assert seen == {"marker": False, "stale": False}
    assert (path / MARKER).is_file()


def test_every_file_and_directory_is_fsynced_before_the_marker(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        synced.append(str(Path(f"/proc/self/fd/{descriptor}").readlink()))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = _save(tmp_path / "ckpt", 1, seed=0)
    marker_at = synced.index(str(path / f".{MARKER}.tmp"))
    before = set(synced[:marker_at])
    written = {str(item) for item in path.rglob("*") if item.name != MARKER}
    assert written <= before, written - before
    assert str(path) in before and str(path / "rng") in before
    assert str(path) in synced[marker_at + 1 :]  # the marker's own name is made durable too


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_complete_one(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 1, seed=0)
    newest = _save(root, 2, seed=2)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a power loss mid-write, say
    model, optimizer = _model_and_optimizer(7)
    checkpointer = JobCheckpointer(root, keep_last=3, rank=0)
    with pytest.warns(RuntimeWarning, match=r"cannot load checkpoint .*step-00000002.*trying the previous"):
        loaded = checkpointer.load_newest({"app": ModelAndOptimizer(model, optimizer)}, lambda path: path.name)
    assert loaded == (root / "step-00000001", "step-00000001")
    expected, _ = _model_and_optimizer(0)
    assert torch.equal(model.weight, expected.weight) and torch.equal(model.bias, expected.bias)
