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
    assert "[rank1]: Traceback (most recent call last):" in log.read_text()  # torch's prefix, as real ranks print
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


def test_interleaved_rank_prefixed_tracebacks_give_the_last_ranks_own_lines():
    # What two ranks with a process group print when both fail (torch prefixes each line with its rank), then torchrun.
    log = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            "[rank1]: Traceback (most recent call last):",
            '[rank0]:   File "model.py", line 3, in build',
            '[rank1]:   File "model.py", line 3, in build',
            "[rank0]:     return FlashAttention2()",
            "[rank0]: BackendUnavailable: the attention backend 'flash_attn_2' needs the flash_attn package",
            "[rank1]:     return FlashAttention2()",
            "[rank1]: BackendUnavailable: the attention backend 'flash_attn_2' needs the flash_attn package",
            "Traceback (most recent call last):",
            '  File "torch/distributed/run.py", line 9, in main',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        ]
    )
    assert last_rank_error(log) == "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "model.py", line 3, in build',
            "    return FlashAttention2()",
            "BackendUnavailable: the attention backend 'flash_attn_2' needs the flash_attn package",
        ]
    )
