"""`d9d run` under the signals an operator sends, against real processes: the embedded Prefect API, torchrun and
its ranks.

- Ctrl-C: the terminal sends SIGINT to the whole foreground process group. The ranks stop and checkpoint, and the run
  ends within seconds with exit code 130 and one line saying what was kept; no connection-error tracebacks (the
  embedded API runs in a session of its own, so the terminal's signal never reaches it).
- `kill -9` of the `d9d` process: nothing it started outlives it (the embedded API and torchrun get SIGTERM from
  the kernel when it dies; torchrun takes its ranks with it).

Isolated: each test runs a real `d9d` process with its own embedded API.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from d9d.core.checkpoint import latest_complete
from d9d.flows.cli import EXIT_INTERRUPTED
from d9d.flows.jobs.data_prep import prepare_data
from d9d.flows.jobs.loading import load_job_config

pytestmark = pytest.mark.isolated


def _start_pretrain(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """`d9d run pretrain` on prepared data, as a terminal would start it: the leader of its own process group."""
    workdir = tmp_path / "run"
    config = load_job_config(preset_name="micro", config_file=None, overrides=[f"workdir={workdir}"])
    prepare_data(config.data_prep, config.data_prep_output)
    argv = [
        "run", "pretrain", "--preset", "micro", "--set", f"workdir={workdir}", "--set", "pretrain.init_from=random",
        "--set", "pretrain.steps=400", "--set", "pretrain.checkpoint_every=2",
    ]  # fmt: skip
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env["D9D_HOME"] = str(tmp_path / "home")
    log = (tmp_path / "d9d.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "d9d.flows.cli", *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    return process, workdir / ".pretrain.partial" / "checkpoints"


def _wait_for_a_checkpoint(process: subprocess.Popen[bytes], checkpoints: Path, log: Path) -> dict[int, psutil.Process]:
    """Every descendant of the running `d9d` once its ranks have written a complete checkpoint."""
    cli = psutil.Process(process.pid)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 300
    while not (checkpoints.is_dir() and latest_complete(checkpoints) is not None):
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        seen.update({child.pid: child for child in cli.children(recursive=True)})
        time.sleep(0.1)
    seen.update({child.pid: child for child in cli.children(recursive=True)})
    commands = [" ".join(proc.cmdline()) for proc in seen.values() if proc.is_running()]
    assert any("uvicorn" in command for command in commands), commands  # the embedded API
    assert sum("d9d.flows.jobs.pretrain.program" in command for command in commands) >= 3  # torchrun and 2 ranks
    return seen


def _api_port(seen: dict[int, psutil.Process]) -> int:
    (server,) = [proc for proc in seen.values() if proc.is_running() and "uvicorn" in " ".join(proc.cmdline())]
    command = server.cmdline()
    return int(command[command.index("--port") + 1])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_ctrl_c_stops_the_ranks_and_ends_the_run_within_seconds_with_130_and_what_was_kept(tmp_path):
    process, checkpoints = _start_pretrain(tmp_path)
    log = tmp_path / "d9d.log"
    try:
        seen = _wait_for_a_checkpoint(process, checkpoints, log)
        assert all(os.getpgid(proc.pid) != process.pid for proc in seen.values() if proc.is_running())
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code = process.wait(timeout=120)
        seconds = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
    output = log.read_text()
    assert code == EXIT_INTERRUPTED, output
    assert seconds < 60, f"{seconds:.1f} s from Ctrl-C to exit"  # ~10 s on the 2-core CI machine
    lines = [line for line in output.splitlines() if line.startswith("d9d: interrupted (SIGINT)")]
    assert len(lines) == 1, output
    assert f"kept: data-prep {checkpoints.parents[1] / 'data'}" in lines[0]
    assert f"pretrain checkpoint {checkpoints}" in lines[0]
    assert "Traceback" not in output and "ConnectError" not in output, output
    _, alive = psutil.wait_procs(list(seen.values()), timeout=15)
    assert not alive, [proc.cmdline() for proc in alive]
    newest = latest_complete(checkpoints)
    assert newest is not None and (newest / "COMPLETE").is_file()


def test_kill_9_of_d9d_leaves_no_process_of_the_run_alive(tmp_path):
    process, checkpoints = _start_pretrain(tmp_path)
    log = tmp_path / "d9d.log"
    try:
        seen = _wait_for_a_checkpoint(process, checkpoints, log)
        port = _api_port(seen)
        assert _listening(port)
    finally:
        process.kill()  # SIGKILL: no handler, no atexit, no finally of its own runs
    process.wait()
    started = time.monotonic()
    _, alive = psutil.wait_procs(list(seen.values()), timeout=45)
    assert not alive, [proc.cmdline() for proc in alive]
    assert time.monotonic() - started < 45
    assert not _listening(port)


def test_ctrl_c_while_the_command_is_still_importing_exits_130_without_a_traceback(tmp_path):
    """The `d9d` entry point catches a Ctrl-C that lands in its imports (seconds of torch and pydantic; tens of
    seconds on a loaded machine), where `cli.main` cannot: before, that gave a traceback and death by SIGINT."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env["D9D_HOME"] = str(tmp_path / "home")
    argv = ["run", "pipeline", "--preset", "micro", "--set", f"workdir={tmp_path / 'run'}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "d9d.flows", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    # Ctrl-C once torch's library is mapped: the entry point imports nothing heavy before its handler, so the command
    # is then inside its imports (a fixed sleep raced the interpreter's own start-up on a loaded machine).
    _wait_until_mapped(process.pid, "libtorch", timeout_seconds=60)
    os.killpg(process.pid, signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    text = output.decode(errors="replace")
    assert process.returncode == EXIT_INTERRUPTED, text
    assert "Traceback" not in text, text
    assert "d9d: interrupted (SIGINT)" in text, text
    assert not (tmp_path / "run").exists()


def _wait_until_mapped(pid: int, library: str, *, timeout_seconds: float) -> None:
    """Poll /proc/PID/maps until a mapped file's path contains `library`."""
    deadline = time.monotonic() + timeout_seconds
    maps = Path(f"/proc/{pid}/maps")
    while time.monotonic() < deadline:
        try:
            if library in maps.read_text():
                return
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never mapped {library} within {timeout_seconds} s")
