"""Run a rank program under `torchrun`, stream its output, and make sure no rank outlives a cancelled launch.

`torchrun` starts every rank in a session of its own, so signalling torchrun's process group does not reach the
ranks. The launcher therefore starts torchrun in a new session (Ctrl-C on the terminal reaches only `d9d`), keeps
a record of torchrun's descendants while it runs, and on SIGINT/SIGTERM (Ctrl-C, `kill`, Prefect's cancellation
of a flow run) sends SIGTERM to every rank directly, not to torchrun: torchrun would forward it and SIGKILL the
ranks 30 s later (a fixed timeout), too soon for a large checkpoint. The Trainer's ranks agree to stop, finish the
step and write a complete checkpoint, and torchrun exits once they have. Whatever is left after `grace_seconds`
gets SIGKILL. The signal is then handed to the handler that was installed before (so Prefect or the `d9d` command
report the interruption). torchrun runs under `parent_death`: if the launcher's process dies (`kill -9`), torchrun
gets SIGTERM and takes its ranks with it.

`python -m d9d.flows.jobs.launch --grace SECONDS -- torchrun ARGS...` is the same stopper for one node of a cluster
job (the Slurm and Kubernetes templates run it in place of a bare `torchrun`): SIGTERM or SIGUSR1 from the
scheduler reaches the ranks at once and torchrun's 30 s never applies.

A failing rank: torchrun starts stopping the others (`Sending process N closing signal`); the launcher then asks
every rank still running for its Python stack (SIGUSR2; `prepare_rank` registered faulthandler for it, into
`stacks/rank-R.txt` next to the log), gives them `failure_grace_seconds` to exit and SIGKILLs what is left, so a hung
rank never holds the stage for torchrun's 30 s or a collective's timeout. The `LaunchError` names the rank that
failed first (torchrun's root cause) and where each rank that was still running stood.

Rank 0 reports progress as lines `d9d-progress {json}` on stdout (see `progress_line`); every other line is
copied to the launch log and, if asked, to a callback. No Prefect here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import psutil

from d9d.flows.jobs.parent_death import guarded_command

PROGRESS_PREFIX = "d9d-progress "
STACKS_ENV = "D9D_STACKS_DIR"  # where prepare_rank's faulthandler writes a rank's stack on SIGUSR2
STACK_SIGNAL = signal.SIGUSR2
# torchrun stops the other ranks of a failed group before it reports the failure: its first such line is the sign.
_RANK_FAILED = re.compile(r"Sending process \d+ closing signal|failed \(exitcode: -?\d+\) local_rank: \d+")
_ROOT_CAUSE_FIELDS = re.compile(r"^\s*(rank|exitcode)\s*:\s*(.*)$")
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_NODE_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # USR1: Slurm's `--signal=USR1@N`
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun: from its SIGTERM to its ranks to their SIGKILL


class LaunchError(RuntimeError):
    """The rank program exited with a failure (names the exit code and the log)."""


class LaunchCancelled(RuntimeError):
    """The launch was stopped by a signal; every rank has been stopped (names the signal)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One `torchrun` launch of `python -m module args...` on `nproc_per_node` local ranks."""

    module: str
    args: Sequence[str]
    nproc_per_node: int
    log_file: Path
    grace_seconds: float = 60.0
    failure_grace_seconds: float = 5.0  # after a rank failed: the others' time to exit before SIGKILL
    env: Mapping[str, str] = field(default_factory=dict)


def progress_line(record: Mapping[str, Any]) -> str:
    """The stdout line a rank program prints to report progress to the launcher."""
    return PROGRESS_PREFIX + json.dumps(dict(record), separators=(",", ":"))


def emit_progress(record: Mapping[str, Any]) -> None:
    """Report progress to the launcher (rank 0 of a rank program calls it; a plain run just prints the line)."""
    sys.stdout.write(progress_line(record) + "\n")
    sys.stdout.flush()


def prepare_rank() -> None:
    """Called first by every rank program: dump this rank's Python stack on SIGUSR2 (into the launcher's stacks
    directory when it set one). (That a rank dies with torchrun is d9d-core's `DistributedContext`'s job.)"""
    directory = os.environ.get(STACKS_ENV)
    rank = os.environ.get("RANK", "0")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        stack_file = (Path(directory) / f"rank-{rank}.txt").open("w", encoding="utf-8")  # open for life
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    else:
        faulthandler.register(STACK_SIGNAL, all_threads=True)


def torchrun_command(spec: LaunchSpec) -> list[str]:
    # A rendezvous on a free local port, so two launches on one machine never collide.
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--max-restarts=0",
        "-m", spec.module, *spec.args,
    ]  # fmt: skip


def launch(
    spec: LaunchSpec,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> None:
    """Run `spec` to the end. Raises `LaunchError` on a failed exit, `LaunchCancelled` after a stop signal."""
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    stacks = spec.log_file.parent / "stacks"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", STACKS_ENV: str(stacks), **spec.env}
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on N cores; torch's default would oversubscribe them
    with spec.log_file.open("a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(torchrun_command(spec))}\n")
        log.flush()
        process = subprocess.Popen(
            guarded_command(torchrun_command(spec)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        stopper = _Stopper(process, spec.grace_seconds, failure_grace=spec.failure_grace_seconds)
        with stopper.signals_forwarded():
            output_ended = False
            try:
                _pump(process, stopper, log, on_progress, on_line)
                output_ended = True
            finally:
                # Also when the pump is interrupted (an exception from another signal handler, e.g. Prefect's).
                stopper.stop_all(output_ended=output_ended)
        code = process.wait()
    if stopper.interrupt is not None:
        raise stopper.interrupt  # to Prefect's engine, which ends the flow run Cancelled (or to the caller)
    if stopper.signum is not None:
        name = signal.Signals(stopper.signum).name
        stopper.redeliver()
        raise LaunchCancelled(stopper.signum, f"{spec.module} stopped by {name}; every rank has exited")
    if code != 0:
        details = "".join(f"; {line}" for line in [*stopper.root_cause(), *stopper.stacks(stacks)])
        raise LaunchError(
            f"{spec.module} failed with exit code {code} on {spec.nproc_per_node} ranks{details}; see {spec.log_file}"
        )


def _pump(
    process: subprocess.Popen[str],
    stopper: _Stopper,
    log: IO[str],
    on_progress: Callable[[dict[str, Any]], None] | None,
    on_line: Callable[[str], None] | None,
) -> None:
    """Copy output lines until the process ends; the reader is a thread so that signals are seen promptly."""
    lines: queue.Queue[str | None] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, name="d9d-launch-reader", daemon=True)
    reader.start()
    while True:
        try:
            stopper.watch()
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
        except BaseException as error:
            if stopper.caught(error):  # the ranks are stopping: keep reading until they have written their last
                continue
            raise
        if line is None:
            break
        stopper.read(line)
        # Ranks share one pipe: a line another rank left unterminated (a warning on stderr) can end up in front
        # of a progress record, so the record is found anywhere in the line, and what precedes it is output.
        start = line.find(PROGRESS_PREFIX)
        if start >= 0:
            if on_progress is not None:
                on_progress(json.loads(line[start + len(PROGRESS_PREFIX) :]))
            if start == 0:
                continue
            line = line[:start] + "\n"
        log.write(line)
        log.flush()
        if on_line is not None:
            on_line(line.rstrip("\n"))
    reader.join(timeout=5)


def keeps_its_handler(handler: object) -> bool:
    """Whether a stop signal's installed `handler` stays in place while a launch runs: Prefect's SIGTERM bridge
    (`prefect.utilities.engine`, recognised by its module: no Prefect import here). Prefect acknowledges its runner's
    cancel intent only while that handler is installed, and only then reports a cancelled flow run Cancelled rather
    than Crashed; it raises `TerminationSignal`, which the launch then treats as the stop signal."""
    return callable(handler) and str(getattr(handler, "__module__", "")).startswith("prefect.")


def redeliver_signal(signum: int, previous: Any) -> None:
    """Hand `signum`, caught while a launch was stopped, to `previous`, the handler installed before (Prefect's, the
    CLI's, or the default action: KeyboardInterrupt for SIGINT, the signal itself otherwise)."""
    if callable(previous):
        previous(signum, None)
    elif previous == signal.SIG_DFL and signum == signal.SIGINT:
        raise KeyboardInterrupt
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


class _Stopper:
    """Tracks torchrun's process tree and stops all of it: SIGTERM first, SIGKILL after the grace period."""

    def __init__(self, process: subprocess.Popen[Any], grace_seconds: float, *, failure_grace: float = 5.0) -> None:
        self._process = process
        self._grace = grace_seconds
        self._failure_grace = failure_grace
        self._failed_at: float | None = None
        self._asked_for_stacks: list[str] = []  # RANKs asked to dump their stack
        self._output: list[str] = []  # torchrun's failure report
        self._known: dict[int, psutil.Process] = {}
        self._deadline: float | None = None
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        self.interrupt: BaseException | None = None  # raised by a handler left in place (Prefect's)
        self._last_scan = 0.0

    # Signals ---------------------------------------------------------------------------------------------------

    def signals_forwarded(self, signals: Sequence[int] = _STOP_SIGNALS) -> _Forwarding:
        return _Forwarding(self, signals)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signum is None:
            self.signum = signum
            self._deadline = time.monotonic() + self._grace
            self._scan()
            self._ask_to_stop()

    def caught(self, error: BaseException) -> bool:
        """Whether `error`, raised while the output is pumped, is a stop to carry out gracefully (recorded, and the
        ranks asked to stop as for a signal): the first interrupt that is not an `Exception` (Prefect's
        `TerminationSignal` from its SIGTERM handler, KeyboardInterrupt) is; a crash or a second interrupt is not."""
        if isinstance(error, Exception) or self.signum is not None or self.interrupt is not None:
            return False
        self.interrupt = error
        self.on_signal(int(getattr(error, "signal", signal.SIGTERM)), None)
        return True

    def redeliver(self) -> None:
        """Hand the stop signal to the handler that was there before (Prefect's, the CLI's, or the default)."""
        assert self.signum is not None
        redeliver_signal(self.signum, self._previous.get(self.signum))

    # The process tree ------------------------------------------------------------------------------------------

    def watch(self) -> None:
        """Called every poll: remember new descendants (ranks), and SIGKILL what outlives the grace period."""
        now = time.monotonic()
        if now - self._last_scan >= 1.0:
            self._scan()
        if self._deadline is not None and now >= self._deadline:
            self._signal_all(signal.SIGKILL)
        if self._failed_at is not None and self.signum is None and now >= self._failed_at + self._failure_grace:
            for proc in self._ranks():  # hung or slow to notice: torchrun itself then exits with its report
                _send(proc, signal.SIGKILL)

    # A failed rank -------------------------------------------------------------------------------------------------

    def read(self, line: str) -> None:
        """Follow torchrun's output: its first `failed (exitcode ...)` starts the failure handling; its root-cause
        report is kept for the error message."""
        if self._failed_at is None and self.signum is None and _RANK_FAILED.search(line):
            self._failed_at = time.monotonic()
            self._scan()
            for proc in self._ranks():
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    self._asked_for_stacks.append(proc.environ().get("RANK", "?"))
                    proc.send_signal(STACK_SIGNAL)
        if self._failed_at is not None:
            self._output.append(line)

    def root_cause(self) -> list[str]:
        """torchrun's root cause, e.g. `first failure: rank 1 (local_rank: 1), exitcode -9 (pid: 123)`."""
        text = "".join(self._output)
        block = text.split("Root Cause", 1)[1] if "Root Cause" in text else ""
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if match := _ROOT_CAUSE_FIELDS.match(line):
                fields.setdefault(match.group(1), match.group(2).strip())
        if "rank" not in fields:
            return []
        signal_note = re.search(r"Signal \d+ \((SIG\w+)\) received", block)
        cause = f"exitcode {fields.get('exitcode', '?')}" + (f", {signal_note.group(1)}" if signal_note else "")
        return [f"first failure: rank {fields['rank']}, {cause}"]

    def stacks(self, directory: Path) -> list[str]:
        """Where each rank still running at the failure stood: the innermost frames of its dumped stack."""
        lines = []
        for rank in sorted(set(self._asked_for_stacks)):
            path = directory / f"rank-{rank}.txt"
            frames = [m.groups() for m in map(_FRAME.match, _read(path).splitlines()) if m is not None]
            if frames:
                shown = " < ".join(f"{name} ({Path(file).name}:{line})" for file, line, name in frames[:3])
                lines.append(f"rank {rank} was still running, in {shown} (whole stack: {path})")
        return lines

    def _ranks(self) -> list[psutil.Process]:
        return [proc for proc in self._alive() if proc.pid != self._process.pid and _is_rank(proc)]

    def stop_all(self, *, output_ended: bool) -> None:
        """Leave nothing running: torchrun and every rank it ever had (SIGTERM, wait the grace period, SIGKILL)."""
        self._scan()
        if output_ended and self.signum is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)  # its output ended: torchrun is on its way out
        # torchrun is reaped through Popen (so its exit code survives), the ranks through psutil.
        ranks = [proc for proc in self._alive() if proc.pid != self._process.pid]
        if self._process.poll() is None or ranks:
            self._ask_to_stop()
            deadline = self._deadline if self._deadline is not None else time.monotonic() + self._grace
            try:
                self._process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            _, ranks = psutil.wait_procs(ranks, timeout=max(deadline - time.monotonic(), 0.0))
            for proc in ranks:
                _send(proc, signal.SIGKILL)
            psutil.wait_procs(ranks, timeout=10)

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        try:
            root = psutil.Process(self._process.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            self._known.setdefault(proc.pid, proc)

    def _alive(self) -> list[psutil.Process]:
        # psutil.Process.is_running compares the creation time too, so a reused pid is never signalled.
        return [proc for proc in self._known.values() if proc.is_running()]

    def _signal_all(self, signum: int) -> None:
        for proc in self._alive():
            _send(proc, signum)

    def _ask_to_stop(self) -> None:
        """SIGTERM to the ranks themselves (torchrun would SIGKILL them 30 s after forwarding it); to torchrun only
        while it has no ranks (still in its rendezvous), or once they are gone."""
        ranks = [proc for proc in self._alive() if proc.pid != self._process.pid and _is_rank(proc)]
        for proc in ranks or self._alive():
            _send(proc, signal.SIGTERM)


class _Forwarding:
    """Install the stopper's handler for the stop signals while the launch runs (main thread only)."""

    def __init__(self, stopper: _Stopper, signals: Sequence[int] = _STOP_SIGNALS) -> None:
        self._stopper = stopper
        self._signals = signals

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread; a caller elsewhere stops us by its own means
        for signum in self._signals:
            if not keeps_its_handler(signal.getsignal(signum)):
                self._stopper._previous[signum] = signal.signal(signum, self._stopper.on_signal)

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._stopper._previous.items():
            if signal.getsignal(signum) == self._stopper.on_signal:  # unless someone installed another since
                signal.signal(signum, previous)


def _send(proc: psutil.Process, signum: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        proc.send_signal(signum)


def _is_rank(proc: psutil.Process) -> bool:
    """torchrun's workers carry their rank in the environment; torchrun's helpers (the parent_death wrapper
    exec'ed into torchrun, a multiprocessing resource tracker) do not."""
    try:
        return "LOCAL_RANK" in proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _read(path: Path) -> str:
    for _ in range(20):  # faulthandler writes from a signal handler: give it a moment
        with contextlib.suppress(OSError):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text:
                return text
        time.sleep(0.05)
    return ""


def run_node(command: Sequence[str], *, grace_seconds: float) -> int:
    """Run `command` (a torchrun) to the end as one node of a cluster job: stop signals go to its ranks directly,
    SIGKILL after `grace_seconds`. Returns torchrun's exit code, or 128 + the signal after a stop.

    A scheduler signals every process of the job step, torchrun included (Slurm's `scancel --signal`, proctrack), and
    torchrun SIGKILLs its ranks `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (30 by default) after a SIGTERM: it gets the
    grace period too, so the ranks' checkpoint is bounded by `grace_seconds` alone."""
    env = {**os.environ, SHUTDOWN_TIMEOUT_ENV: str(math.ceil(grace_seconds))}
    process = subprocess.Popen(list(command), start_new_session=True, env=env)
    stopper = _Stopper(process, grace_seconds)
    with stopper.signals_forwarded(_NODE_STOP_SIGNALS):
        try:
            while process.poll() is None:
                stopper.watch()
                time.sleep(0.2)
        finally:
            stopper.stop_all(output_ended=True)
    code = process.wait()
    return 128 + stopper.signum if stopper.signum is not None else code


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m d9d.flows.jobs.launch",
        description="Run torchrun as one node of a cluster job; stop signals go to the ranks directly.",
    )
    parser.add_argument("--grace", type=float, required=True, help="seconds from the stop signal to SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- torchrun --nnodes 2 ...")
    return run_node(command, grace_seconds=args.grace)


if __name__ == "__main__":
    sys.exit(main())
