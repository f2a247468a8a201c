"""A job checkpoint written under one layout resumes under another (DCP reshards), with the same global batch.

tp2 x dp_shard2 -> dp_shard4 and dp_shard4 -> tp2 x dp_shard2 on 4 gloo ranks: a job of 8 steps is preempted
(SIGTERM, as a scheduler does) at step 4 and checkpoints; a new Trainer on the other layout resumes it to step 8.
Every step's loss must equal single-process whole-batch training of 8 steps within 2e-5 (float32 summation order
only; measured about 5e-7): the resumed model, AdamW moments, LR schedule and data position are all right only if all
of them were resharded.
"""

import os
import signal
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "loop"))  # the Trainer workload of the loop tests
from loop_workload import build_tiny_trainer, reference_losses

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import EventBus, StepStarted

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

TOLERANCE = 2e-5
TP2_DP2 = MeshDegrees(dp_shard=2, tp=2)
DP4 = MeshDegrees(dp_shard=4)


def _train(degrees: MeshDegrees, family: str, directory: Path, *, preempt_at: int | None) -> dict[int, float]:
    ctx = DistributedContext.build(degrees, device="cpu")
    events = EventBus()
    if preempt_at is not None:
        events.subscribe(
            StepStarted, lambda event: os.kill(os.getpid(), signal.SIGTERM) if event.step == preempt_at else None
        )
    trainer = build_tiny_trainer(
        ctx,
        family=family,
        parallel="fsdp",
        total_steps=8,
        checkpoint_dir=directory,
        checkpoint_every=100,
        events=events,
    )
    result = trainer.train()
    if preempt_at is None:
        assert result.resumed_from is not None and result.resumed_from.name.endswith("4"), result.resumed_from
    else:
        assert result.preempted and result.last_step == preempt_at
    return result.losses


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after"), [(TP2_DP2, DP4), (DP4, TP2_DP2)], ids=["tp2xdp2-to-dp4", "dp4-to-tp2xdp2"]
)
@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=4, timeout=600)
def test_checkpoint_resumes_under_another_layout(family, before, after, tmp_path):
    directory = tmp_path / "checkpoints"  # one path for every rank: the ranks fork from the test process
    losses = _train(before, family, directory, preempt_at=4)
    losses.update(_train(after, family, directory, preempt_at=None))
    if dist.get_rank() == 0:
        reference = reference_losses(family, total_steps=8)
        worst = max(abs(losses[step] - reference[step - 1]) for step in range(1, 9))
        print(f"{family} {before.describe()} -> {after.describe()}: max |loss - single-process| = {worst:.2e}")
        assert worst <= TOLERANCE, (losses, reference)
    dist.barrier()
