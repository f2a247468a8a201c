"""The launcher against real torchrun process groups (a stand-in rank program, 2 ranks): output and progress are
streamed, a failure names its exit code, and a stop signal leaves no rank alive, SIGKILLing those that ignore SIGTERM.

Isolated: the launcher reads output in a thread, and these tests signal the pytest process itself.
"""

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from d9d.flows.jobs.launch import LaunchCancelled, LaunchError, LaunchSpec, launch

pytestmark = pytest.mark.isolated

HERE = Path(__file__).parent


def _spec(tmp_path: Path, mode: str, grace: float = 20.0) -> LaunchSpec:
    """2 ranks of the stand-in rank program under the launcher's torchrun."""
    return LaunchSpec(
        module="launch_rank_program",
        args=[str(tmp_path), mode],
        nproc_per_node=2,
        log_file=tmp_path / "launch.log",
        grace_seconds=grace,
        env={"PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"},  # this checkout's d9d, not an installed one
    )


def _rank_pids(tmp_path: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(tmp_path.glob("rank-*.pid"))]


def _signal_when_ranks_run(tmp_path: Path, signum: int) -> threading.Thread:
    def send() -> None:
        deadline = time.monotonic() + 60
        while len(_rank_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        signal.raise_signal(signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_progress_lines_reach_the_callback_and_other_lines_the_log(tmp_path):
    records, lines = [], []
    launch(_spec(tmp_path, "finish"), on_progress=records.append, on_line=lines.append)
    assert [record["step"] for record in records] == [0, 1, 2, 3]
    assert records[-1]["loss"] == pytest.approx(1 / 3)
    assert "rank 1 step 3" in lines
    log = (tmp_path / "launch.log").read_text()
    assert "rank 0 step 2" in log and "d9d-progress" not in log


def test_a_failing_rank_fails_the_launch_naming_the_exit_code_and_the_log(tmp_path):
    with pytest.raises(
        LaunchError, match=r"exit code 1 on 2 ranks; first failure: rank 1 .*exitcode 3 .*; see .*launch.log"
    ):
        launch(_spec(tmp_path, "fail"))
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_every_rank_after_it_checkpoints_then_reaches_the_previous_handler(tmp_path, signum):
    seen = []

    def previous(number, frame):
        seen.append(number)

    old = signal.signal(signum, previous)
    try:
        _signal_when_ranks_run(tmp_path, signum)
        with pytest.raises(LaunchCancelled) as cancelled:
            launch(_spec(tmp_path, "wait"))
    finally:
        signal.signal(signum, old)
    assert cancelled.value.signum == signum
    assert seen == [signum]  # Prefect's handler (or the CLI's) still hears about it
    assert sorted(path.name for path in tmp_path.glob("rank-*.stopped")) == ["rank-0.stopped", "rank-1.stopped"]
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))


class _Termination(BaseException):
    """Stands for Prefect's `TerminationSignal` (a BaseException carrying the signal number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signum


def _prefects_handler(signum, frame):
    raise _Termination(signum)


_prefects_handler.__module__ = "prefect.utilities.engine"  # how the launcher recognises Prefect's SIGTERM bridge


def test_prefects_sigterm_handler_stays_installed_and_its_exception_stops_every_rank_gracefully(tmp_path):
    # Prefect acknowledges a worker's cancel request only while its handler is installed (then the flow run ends
    # Cancelled, not Crashed): the launch leaves it in place, stops the ranks when it raises, then re-raises it.
    installed = []

    def progress(record):
        installed.append(signal.getsignal(signal.SIGTERM))

    old = signal.signal(signal.SIGTERM, _prefects_handler)
    try:
        _signal_when_ranks_run(tmp_path, signal.SIGTERM)
        with pytest.raises(_Termination) as raised:
            launch(_spec(tmp_path, "wait"), on_progress=progress)
        assert signal.getsignal(signal.SIGTERM) is _prefects_handler
    finally:
        signal.signal(signal.SIGTERM, old)
    assert raised.value.signal == signal.SIGTERM
    assert installed and all(handler is _prefects_handler for handler in installed)
    assert sorted(path.name for path in tmp_path.glob("rank-*.stopped")) == ["rank-0.stopped", "rank-1.stopped"]
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    old = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        _signal_when_ranks_run(tmp_path, signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(LaunchCancelled):
            launch(_spec(tmp_path, "stubborn", grace=2.0))
    finally:
        signal.signal(signal.SIGTERM, old)
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert time.monotonic() - started < 60


def test_an_exception_while_streaming_still_stops_every_rank(tmp_path):
    """E.g. Prefect's own SIGTERM handler, armed after the launch began, raising inside the launcher's loop."""

    def interrupted(record):
        while len(_rank_pids(tmp_path)) < 2:
            time.sleep(0.05)
        raise RuntimeError("interrupted by another handler")

    with pytest.raises(RuntimeError, match="interrupted by another handler"):
        launch(_spec(tmp_path, "wait"), on_progress=interrupted)
    assert sorted(path.name for path in tmp_path.glob("rank-*.stopped")) == ["rank-0.stopped", "rank-1.stopped"]
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))


def test_ranks_get_the_whole_grace_period_not_torchruns_30_seconds(tmp_path):
    """The stop signal goes to the ranks, not torchrun (which would SIGKILL them 30 s after forwarding it): ranks that
    need 35 s to checkpoint finish within a 90 s grace period."""
    _signal_when_ranks_run(tmp_path, signal.SIGTERM)
    old = signal.signal(signal.SIGTERM, lambda *_: None)
    started = time.monotonic()
    try:
        with pytest.raises(LaunchCancelled):
            launch(_spec(tmp_path, "slow-stop", grace=90.0))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert sorted(path.name for path in tmp_path.glob("rank-*.stopped")) == ["rank-0.stopped", "rank-1.stopped"]
    assert 35 <= time.monotonic() - started < 90
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))


def test_the_node_launcher_of_cluster_jobs_hands_sigusr1_to_the_ranks_for_the_whole_grace_period(tmp_path):
    """`python -m d9d.flows.jobs.launch --grace N -- torchrun ...`, as the Slurm and Kubernetes templates run it: the
    scheduler's early signal (Slurm `--signal=USR1@N`, a pod's SIGTERM) reaches the ranks, which get all N seconds."""
    import subprocess
    import sys

    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0", "--max-restarts=0", "-m", "launch_rank_program", str(tmp_path), "slow-stop",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    node = subprocess.Popen(
        [sys.executable, "-m", "d9d.flows.jobs.launch", "--grace", "90", "--", *torchrun],
        env=env,
        stdout=(tmp_path / "node.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while len(_rank_pids(tmp_path)) < 2:
        assert node.poll() is None and time.monotonic() < deadline, (tmp_path / "node.log").read_text()
        time.sleep(0.1)
    time.sleep(0.5)
    node.send_signal(signal.SIGUSR1)
    assert node.wait(timeout=120) == 128 + signal.SIGUSR1
    assert sorted(path.name for path in tmp_path.glob("rank-*.stopped")) == ["rank-0.stopped", "rank-1.stopped"]
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))


def test_a_hung_rank_is_found_by_the_collective_timeout_named_with_its_stack_and_killed(tmp_path):
    """Rank 1 hangs outside any collective, rank 0 waits for it in a barrier (5 s timeout): the launch fails within
    seconds, naming the rank that failed first and where the hung one stood, and no rank is left (torchrun alone would
    give the hung rank another 30 s)."""
    started = time.monotonic()
    with pytest.raises(LaunchError) as failed:
        launch(_spec(tmp_path, "hang"))
    seconds = time.monotonic() - started
    message = str(failed.value)
    assert "first failure: rank 0" in message, message
    assert "rank 1 was still running, in hang_forever (launch_rank_program.py:" in message, message
    assert (tmp_path / "stacks" / "rank-1.txt").read_text().count("hang_forever") >= 1
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))
    # Killed by the launcher 5 s after the failure, not by torchrun after its own 30 s ("Unable to shutdown ...").
    assert "Unable to shutdown process" not in (tmp_path / "launch.log").read_text(), f"{seconds:.1f} s"


def test_a_sigkilled_rank_fails_the_launch_naming_the_rank_and_the_signal(tmp_path):
    with pytest.raises(LaunchError) as failed:
        launch(_spec(tmp_path, "sigkill"))
    message = str(failed.value)
    assert "first failure: rank 1" in message and "exitcode -9" in message and "SIGKILL" in message, message
    assert not any(psutil.pid_exists(pid) for pid in _rank_pids(tmp_path))
