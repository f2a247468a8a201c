"""Cancelling a running `d9d run pipeline` with SIGTERM (what `kill`, a scheduler or Prefect's process worker send):
torchrun and every rank exit, the command reports the interruption (exit code 143), the newest checkpoint is
complete, and running the stage again resumes from it and completes.

The cancelled run is a real `d9d` process with its own embedded Prefect API; the rerun runs in this process
against the session's. Isolated: Prefect starts threads.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from d9d.core.checkpoint import is_complete, latest_complete
from d9d.flows.cli import EXIT_TERMINATED, main
from d9d.flows.jobs.contract import StageManifest

pytestmark = pytest.mark.isolated


def _descendants(process: psutil.Process) -> dict[int, psutil.Process]:
    try:
        return {child.pid: child for child in process.children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def _command_line(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.NoSuchProcess:  # a short-lived helper of an earlier stage
        return ""


def test_sigterm_stops_every_rank_keeps_a_complete_checkpoint_and_the_rerun_resumes(prefect_api, tmp_path, capsys):
    argv = [
        "run", "pipeline", "--preset", "micro", "--set", f"workdir={tmp_path}", "--set", "pretrain.steps=40",
        "--set", "pretrain.checkpoint_every=2", "--set", "evaluate.base=false",
    ]  # fmt: skip
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env["D9D_HOME"] = str(tmp_path / "home")
    command = [sys.executable, "-m", "d9d.flows.cli", *argv]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cli = psutil.Process(process.pid)
    checkpoints = tmp_path / ".pretrain.partial" / "checkpoints"
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 900  # data prep, conversion and the API start: 5.5 min at load 26 on 2 cores
    while latest_complete(checkpoints) is None if checkpoints.is_dir() else True:
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "no checkpoint within 900 s"
        seen.update(_descendants(cli))
        time.sleep(0.1)
    seen.update(_descendants(cli))
    ranks = [proc for proc in seen.values() if "d9d.flows.jobs.pretrain.program" in _command_line(proc)]
    assert len(ranks) >= 2  # torchrun and its two ranks share the module argument

    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == EXIT_TERMINATED, output
    assert "d9d: interrupted" in output
    assert not [proc for proc in ranks if proc.is_running()], "torchrun or a rank survived"
    _, alive = psutil.wait_procs(list(seen.values()), timeout=15)  # and nothing else the command started
    assert not alive, [_command_line(proc) for proc in alive]
    newest = max(checkpoints.glob("step-*"))
    assert is_complete(newest), f"{newest} is the newest checkpoint and is not complete"
    assert not (tmp_path / "pretrain").exists()  # not committed: the stage did not finish

    argv[1] = "pretrain"  # the same job, the stage alone: its key is unchanged, so its checkpoints are kept
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pretrain: ran" in out
    statistics = StageManifest.read(tmp_path / "pretrain").statistics
    assert statistics["resumed_from"].endswith(newest.name)
    assert latest_complete(tmp_path / "pretrain" / "checkpoints").name == "step-00000040"
