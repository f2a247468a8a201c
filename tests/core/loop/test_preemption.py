"""SIGTERM on one rank stops every rank after the same step; the agreement is a host-side collective (gloo).

The kill tests (`test_kill_and_resume.py`) SIGTERM every rank of a `torchrun` job; here only one rank gets it, so the
other ranks learn of it only through the agreement.
"""

import os
import signal

import pytest
from loop_workload import build_tiny_trainer

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import EventBus, StepStarted
from d9d.core.loop.preemption import PreemptionFlag

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")


@pytest.mark.distributed(world_size=1)
def test_one_process_agrees_with_its_own_flag():
    flag = PreemptionFlag()
    flag.install()
    try:
        assert not flag.agreed(None)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on with the flag set
        assert flag.agreed(None)
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not flag._handle  # the previous handler is back


@pytest.mark.distributed(world_size=2, timeout=120)
def test_sigterm_on_one_rank_is_agreed_by_every_rank():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2))
    flag = PreemptionFlag()
    flag.install()
    try:
        assert not flag.agreed(ctx.control_group)
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        assert flag.agreed(ctx.control_group)  # rank 0 never got the signal
    finally:
        flag.uninstall()


@pytest.mark.distributed(world_size=2, timeout=240)
def test_trainer_stops_every_rank_after_the_step_in_which_one_rank_got_sigterm():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    events = EventBus()
    if ctx.rank == 0:
        events.subscribe(StepStarted, lambda event: os.kill(os.getpid(), signal.SIGTERM) if event.step == 3 else None)
    trainer = build_tiny_trainer(ctx, family="dense", parallel="fsdp", total_steps=8, global_rows=4, events=events)
    result = trainer.train()
    assert (result.last_step, result.preempted) == (3, True)
    assert sorted(result.losses) == [1, 2, 3]
