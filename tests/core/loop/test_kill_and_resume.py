"""Kill, preempt and resume real `torchrun` process groups (2 gloo ranks, FSDP, tiny dense Qwen3).

One uninterrupted 20-step run is the reference. Then, in one checkpoint directory: SIGKILL every rank mid-step 13
(checkpoints every 5 steps: 5 and 10 are complete); resume with rank 1 SIGKILLed as the checkpoint of step 15
starts writing (step 15 is left without a completion marker); resume again, which must take step 10, not 15,
and reproduce steps 11-20 bit for bit. The step-10 checkpoint resumed on 1 rank matches within 1e-5 (another
data-parallel size sums in another order). A separate run gets SIGTERM on every rank at step 7: it finishes
the step, writes a complete checkpoint of step 7 and exits 0. A 4-rank checkpoint resumes on 2 ranks (the
accumulation doubles, the global batch stays) within 1e-5 of the 4-rank run; on 3 ranks it fails, saying why.
Launches that do not depend on each other run side by side (see `_start`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from d9d.core.checkpoint import is_complete, latest_complete

PROGRAM = Path(__file__).with_name("rank_program.py")
_STARTED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_launch_outlives_its_test() -> Iterator[None]:
    """A test that fails while a launch of its own still runs kills it with its ranks (its process group)."""
    yield
    while _STARTED:
        _kill(_STARTED.pop())


def _kill(launch: subprocess.Popen[bytes]) -> None:
    if launch.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
        launch.wait(timeout=60)


def _start(out: Path, nproc: int, *faults: str) -> subprocess.Popen[bytes]:
    """A `torchrun` launch of `nproc` ranks writing into `out`, its output appended to `out/launch.log`."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--max-restarts=0",
        str(PROGRAM), "--out", str(out), *faults,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out.mkdir(parents=True, exist_ok=True)
    with (out / "launch.log").open("ab") as log:  # the child holds its own copy of the descriptor
        # Its own process group, so that a launch left behind is killed with its ranks (`_kill`).
        launch = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _STARTED.append(launch)
    return launch


def _wait(*launches: subprocess.Popen[bytes]) -> list[int]:
    """The exit codes of `launches`; one that runs past 240 s is killed and fails the test."""
    codes = []
    for launch in launches:
        try:
            codes.append(launch.wait(timeout=240))
        except subprocess.TimeoutExpired:
            for other in launches:
                _kill(other)
            raise
    return codes


def _launch(out: Path, nproc: int, *faults: str) -> int:
    (code,) = _wait(_start(out, nproc, *faults))
    return code


# Independent launches (their own output directories, faults triggered by training events, not by timing) run at
# the same time: most of a launch is torchrun importing torch, then each rank importing torch, d9d and DTensor, much
# of it on one core of two, so two launches side by side take far less than one after the other.


def _losses(out: Path) -> dict[int, float]:
    """Step -> loss; a step logged by several attempts keeps its last value."""
    lines = (out / "losses.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {record["step"]: float.fromhex(record["loss"]) for record in records}


@pytest.mark.slow
def test_sigkill_mid_step_and_mid_checkpoint_then_resume_is_bitwise_exact(tmp_path):
    reference_dir, run_dir, other_size_dir = tmp_path / "reference", tmp_path / "run", tmp_path / "one-rank"
    reference_code, killed_code = _wait(_start(reference_dir, 2), _start(run_dir, 2, "--kill-at", "13"))
    assert reference_code == 0
    reference = _losses(reference_dir)
    assert sorted(reference) == list(range(1, 21))

    assert killed_code != 0
    checkpoints = run_dir / "checkpoints"
    assert latest_complete(checkpoints) == checkpoints / "step-00000010"
    assert max(_losses(run_dir)) == 12  # step 13 never finished

    shutil.copytree(checkpoints / "step-00000010", other_size_dir / "checkpoints" / "step-00000010")
    on_one_rank_launch = _start(other_size_dir, 1)  # checked at the end

    assert _launch(run_dir, 2, "--kill-in-checkpoint", "15", "--fault-ranks", "1") != 0
    assert (checkpoints / "step-00000015").is_dir() and not is_complete(checkpoints / "step-00000015")
    assert latest_complete(checkpoints) == checkpoints / "step-00000010"

    assert _launch(run_dir, 2) == 0
    result = json.loads((run_dir / "result.json").read_text())
    assert result["resumed_from"].endswith("step-00000010")
    resumed = _losses(run_dir)
    for step in range(11, 21):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])  # bitwise
    assert is_complete(checkpoints / "step-00000020")
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-00000015", "step-00000020"]

    assert _wait(on_one_rank_launch) == [0]
    on_one_rank = _losses(other_size_dir)
    worst = max(abs(on_one_rank[step] - reference[step]) for step in range(11, 21))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(tmp_path):
    assert _launch(tmp_path, 2, "--sigterm-at", "7") == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"last_step": 7, "preempted": True, "resumed_from": None}
    assert latest_complete(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000007"
    assert max(_losses(tmp_path)) == 7


@pytest.mark.slow
def test_four_rank_checkpoint_resumes_on_two_ranks_with_the_same_global_batch(tmp_path):
    """4 ranks x 1 micro-batch of 1 row per step; resumed on 2 ranks the accumulation becomes 2 micro-batches, the
    global batch (4 rows, the same rows) is kept. Tolerance 1e-5 per step: only the float32 summation order differs
    (gradients reduced over 2 ranks instead of 4). On 3 ranks 4 rows cannot be split: the error says so."""
    reference_dir, two_dir, three_dir = tmp_path / "four", tmp_path / "two", tmp_path / "three"
    assert _launch(reference_dir, 4, "--every", "10") == 0  # keeps the checkpoints of steps 10 and 20
    reference = _losses(reference_dir)
    checkpoint = reference_dir / "checkpoints" / "step-00000010"
    assert is_complete(checkpoint)
    shutil.copytree(checkpoint, two_dir / "checkpoints" / "step-00000010")
    shutil.copytree(checkpoint, three_dir / "checkpoints" / "step-00000010")

    two_code, three_code = _wait(_start(two_dir, 2), _start(three_dir, 3))
    assert two_code == 0
    result = json.loads((two_dir / "result.json").read_text())
    assert result["resumed_from"].endswith("step-00000010")
    on_two = _losses(two_dir)
    assert sorted(on_two) == list(range(11, 21))
    worst = max(abs(on_two[step] - reference[step]) for step in range(11, 21))
    assert worst <= 1e-5, worst

    assert three_code != 0
    log = (three_dir / "launch.log").read_text()
    assert "global_batch_rows=4 cannot be split into micro-batches of 1 rows over 3 data-parallel ranks" in log
