"""What every launcher shares: the `Launcher` protocol, the output-line dispatch, the stop signals, and the report
of a cluster job (its id, nodes and log) to whoever shows it (the Prefect flow publishes it as an artifact)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, Protocol

from d9d.flows.jobs.launch import PROGRESS_PREFIX, LaunchSpec, keeps_its_handler, redeliver_signal

ProgressCallback = Callable[[dict[str, Any]], None]
LineCallback = Callable[[str], None]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Launcher(Protocol):
    """Runs a `LaunchSpec` to its end: returns on success, raises `LaunchError` on a failure and `LaunchCancelled`
    after a stop signal (once nothing it started runs any more)."""

    def run(
        self,
        spec: LaunchSpec,
        *,
        on_progress: ProgressCallback | None = None,
        on_line: LineCallback | None = None,
        note: LineCallback | None = None,
    ) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ClusterJob:
    """A submitted cluster job, as the stage's run page links it."""

    scheduler: str  # "slurm" or "kubernetes"
    job_id: str
    name: str
    state: str
    nodes: str  # the node list (Slurm) or the pods and their nodes (Kubernetes); "" while pending
    log: str  # where its output is
    script: str = ""  # the submitted sbatch script or manifest

    def rows(self) -> list[dict[str, str]]:
        return [
            {"field": "scheduler", "value": self.scheduler},
            {"field": "job id", "value": self.job_id},
            {"field": "name", "value": self.name},
            {"field": "state", "value": self.state},
            {"field": "nodes", "value": self.nodes},
            {"field": "log", "value": self.log},
            {"field": "job file", "value": self.script},
        ]


ClusterJobObserver = Callable[[ClusterJob], None]
_OBSERVER: ContextVar[ClusterJobObserver | None] = ContextVar("d9d_cluster_job_observer", default=None)


@contextmanager
def observe_cluster_jobs(observer: ClusterJobObserver) -> Iterator[None]:
    """Send every cluster job a launcher submits (and its changes of state) to `observer` within this block."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def report_cluster_job(job: ClusterJob) -> None:
    observer = _OBSERVER.get()
    if observer is not None:
        observer(job)


class LineSink:
    """A rank program's output, line by line: progress records to `on_progress`, every other line to the stage's
    launch log and `on_line` (the same split the local launcher makes on torchrun's pipe)."""

    def __init__(self, log: IO[str], on_progress: ProgressCallback | None, on_line: LineCallback | None) -> None:
        self._log = log
        self._on_progress = on_progress
        self._on_line = on_line

    def __call__(self, line: str) -> None:
        # Ranks share one output: another rank's unterminated line can end up in front of a progress record.
        start = line.find(PROGRESS_PREFIX)
        if start >= 0:
            if self._on_progress is not None:
                self._on_progress(json.loads(line[start + len(PROGRESS_PREFIX) :]))
            if start == 0:
                return
            line = line[:start]
        self._log.write(line + "\n")
        self._log.flush()
        if self._on_line is not None:
            self._on_line(line)


class FileFollower:
    """The complete lines appended to a file since the last call (a file that does not exist yet has none; one that
    shrank, e.g. rewritten by a requeued job, is read again from its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._rest = b""

    def lines(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset, self._rest = 0, b""
        if size == self._offset:
            return []
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read(size - self._offset)
        self._offset += len(data)
        *complete, self._rest = (self._rest + data).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in complete]

    def rest(self) -> list[str]:
        """What is left after the last newline (the job has ended: nothing more will be appended)."""
        rest, self._rest = self._rest, b""
        return [rest.decode("utf-8", errors="replace")] if rest else []


class StopSignals:
    """Records SIGINT/SIGTERM (Ctrl-C, `kill`, a Prefect worker cancelling the flow run) while a cluster job is
    followed, so the follower can stop the job and wait for it; then hands the signal to the handler that was
    installed before, as the local launcher does. Outside the main thread signals never arrive here.

    Prefect's own SIGTERM handler (installed while its engine runs a flow) stays in place: Prefect acknowledges its
    runner's cancel intent only while that handler is installed, and only then reports the cancelled run Cancelled
    rather than Crashed. It raises `TerminationSignal` into the follow loop, which hands it to `caught`, stops the job
    the same way, and re-raises it (`finish`) once the job has ended."""

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS) -> None:
        self._signals = signals
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        self.interrupt: BaseException | None = None  # raised by a handler left in place (Prefect's)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                if not keeps_its_handler(signal.getsignal(signum)):
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signum is None:
            self.signum = signum

    @property
    def stopping(self) -> bool:
        return self.signum is not None or self.interrupt is not None

    def caught(self, error: BaseException) -> bool:
        """Whether `error`, raised in the follow loop, asks for a graceful stop (recorded): the first interrupt
        (KeyboardInterrupt, Prefect's TerminationSignal: not an `Exception`) does; a crash or a second interrupt does
        not (the follower then cancels the job outright and lets it propagate)."""
        if isinstance(error, Exception) or self.stopping:
            return False
        self.interrupt = error
        return True

    def finish(self) -> None:
        """After the stopped job has ended: re-raise the interrupt, or hand the recorded signal to the handler that
        was there before (Prefect's, the CLI's, or the default)."""
        if self.interrupt is not None:
            raise self.interrupt
        assert self.signum is not None
        redeliver_signal(self.signum, self._previous.get(self.signum))
