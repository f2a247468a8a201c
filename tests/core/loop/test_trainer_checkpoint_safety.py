"""The Trainer's resume: a pickle planted as the loop's JSON state is refused and never executed; a checkpoint
that one rank cannot read makes every rank fall back together to the previous complete one."""

import builtins
import json
import pickle
from pathlib import Path

import pytest
import torch
from loop_workload import build_tiny_trainer

from d9d.core.checkpoint import CheckpointLoadError, rng_file
from d9d.core.dist import DistributedContext, MeshDegrees


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
    marker.unlink()  # ... which resuming must never do
    return payload


@pytest.mark.distributed(world_size=1, timeout=120)
def test_a_pickle_planted_as_loop_state_is_refused_never_executed(tmp_path):
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    root = tmp_path / "ckpt"
    build_tiny_trainer(ctx, family="dense", parallel="none", total_steps=4, checkpoint_dir=root).train()
    marker = tmp_path / "pwned"
    (root / "step-00000004" / "trainer_state.json").write_bytes(_malicious_pickle(marker))
    trainer = build_tiny_trainer(ctx, family="dense", parallel="none", total_steps=5, checkpoint_dir=root)
    with (
        pytest.warns(RuntimeWarning, match="step-00000004"),
        pytest.raises(CheckpointLoadError, match=r"trainer_state\.json: not the loop's JSON state"),
    ):
        trainer.train()
    assert not marker.exists()


@pytest.mark.distributed(world_size=2, timeout=180)
def test_trainer_resume_falls_back_when_one_rank_cannot_read_its_rng_state(tmp_path):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    root = tmp_path / "ckpt"
    build_tiny_trainer(
        ctx, family="dense", parallel="fsdp", total_steps=4, checkpoint_dir=root, checkpoint_every=2
    ).train()
    torch.distributed.barrier()
    if ctx.rank == 1:  # only rank 1's file is damaged: both ranks must still agree on the same fallback
        rng_file(root / "step-00000004", 1).write_text('{"format": 1, "python": ')
    torch.distributed.barrier()
    trainer = build_tiny_trainer(
        ctx, family="dense", parallel="fsdp", total_steps=5, checkpoint_dir=root, checkpoint_every=2
    )
    with pytest.warns(RuntimeWarning, match="step-00000004"):
        result = trainer.train()
    assert result.resumed_from == root / "step-00000002"
    assert sorted(result.losses) == [3, 4, 5]
    if ctx.rank == 0:
        state = json.loads((root / "step-00000005" / "trainer_state.json").read_text())
        assert state["step"] == 5 and state["skipped_steps"] == 0
