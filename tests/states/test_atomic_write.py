"""Writes are atomic: a writer killed midway leaves no destination, and what it leaves behind is never taken for a
complete checkpoint."""

import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from states_testing import write_checkpoint

from d9d.states import CheckpointError, CheckpointSource, convert_checkpoint
from d9d.states import mapper as m
from d9d.states.io.inspect import inspect_checkpoint
from d9d.states.mapper.leaf.rename import RenameOp


class _DieAfter(m.OpMapper):
    """Identity that SIGKILLs its own process when the `limit`-th tensor passes through (a crash, not an exception)."""

    def __init__(self, names, limit):
        outer = self

        class Op(RenameOp):
            def moves_only(self, meta):
                return False  # go through `transform`, not the in-place assembly

            def transform(self, tensor):
                outer.seen += 1
                if outer.seen == limit:
                    os.kill(os.getpid(), signal.SIGKILL)
                return tensor

        self.seen = 0
        super().__init__([Op(name, name) for name in names])


def _run_killed(body):
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            body()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def source(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {f"w{i:02d}": torch.randn(64, 64, generator=generator) for i in range(24)}
    return write_checkpoint(tmp_path / "src", tensors, files=3), tensors


def test_a_writer_killed_midway_leaves_nothing_that_reads_as_complete(tmp_path, source):
    src, tensors = source
    dst = tmp_path / "dst"
    # 16 KiB tensors, 3 per shard: when the 20th tensor is being produced, six shards are complete.
    code = _run_killed(lambda: convert_checkpoint(src, dst, _DieAfter(list(tensors), 20), max_shard_bytes=50_000))
    assert code == -signal.SIGKILL
    assert not dst.exists()
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".dst.incomplete-")]
    assert any(p.name.endswith(".safetensors.partial") for p in staging.iterdir())
    with pytest.raises(CheckpointError, match="partially written files"):
        CheckpointSource.open(staging)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        CheckpointSource.open(dst)
    assert inspect_checkpoint(staging).problems
    # The leftover does not get in the way of a new attempt, which completes.
    convert_checkpoint(src, dst, m.Identity(list(tensors)), max_shard_bytes=50_000)
    loaded = {}
    for path in dst.glob("*.safetensors"):
        loaded.update(load_file(path))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_an_error_midway_removes_the_staging_directory(tmp_path, source):
    src, tensors = source

    class Broken(m.Identity):
        def plan_regions(self, group, wanted):
            if "w10" in group:
                raise RuntimeError("disk on fire")
            return super().plan_regions(group, wanted)

    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_checkpoint(src, tmp_path / "dst", Broken(list(tensors)), max_shard_bytes=50_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
