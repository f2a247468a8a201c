"""A failing rank's own error becomes the stage's message (not "see launch.log"): read back from a real torchrun
launch's log, past torchrun's own ChildFailedError traceback."""

from pathlib import Path

import pytest

from d9d.flows.jobs.launch import LaunchSpec, launch
from d9d.flows.jobs.rank_failure import RankProgramError, last_rank_error, rank_errors

pytestmark = pytest.mark.isolated

HERE = Path(__file__).parent


def test_the_failing_ranks_last_traceback_lines_are_the_message(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("Traceback (most recent call last):\nValueError: an earlier attempt's error\n")
    spec = LaunchSpec(
        module="raising_rank_program",
        args=[],
        nproc_per_node=2,
        log_file=log,
        grace_seconds=5.0,
        env={"PYTHONPATH": str(HERE)},
    )
    with (
        pytest.raises(RankProgramError) as raised,
        rank_errors(log, lambda cause: f"pretrain: a rank failed:\n{cause}"),
    ):
        launch(spec)
    message = str(raised.value)
    assert message.startswith("pretrain: a rank failed:\n")
    assert "in check_schedule" in message
    assert "ValueError: phase 1 (mode='steps', steps=20) ends at step 21, past total_steps=10" in message
    assert "earlier attempt" not in message and "ChildFailedError" not in message  # this attempt, the rank's own
    assert message.endswith(f"(full log: {log})")


def test_a_log_without_a_rank_traceback_gives_nothing():
    assert last_rank_error("rank 0 step 1\n") is None
    launcher_only = "Traceback (most recent call last):\n  File x\ntorch.distributed.elastic...ChildFailedError: \n"
    assert last_rank_error(launcher_only) is None
