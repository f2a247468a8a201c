"""The `slurm` launcher: render the sbatch script, submit it, follow the job to its end, and cancel it when the
stage is stopped.

- Submit: `templates/slurm/torchrun.sbatch.j2` rendered for the stage (every value validated by `ClusterJobSpec`
  and quoted by the template), written next to the stage's launch log, `sbatch --parsable`.
- Follow: `scontrol show job` every `poll_seconds` (`sacct` once the controller has forgotten the job); the job's
  output file (on shared storage) is read as it grows and goes through the same line dispatch as a local torchrun's
  pipe: progress records to the stage's progress, every other line to the stage's `launch.log` and logger.
- End: COMPLETED returns; every other end state (FAILED, CANCELLED by someone else, TIMEOUT, PREEMPTED without a
  requeue, NODE_FAIL, OUT_OF_MEMORY, ...) raises a `LaunchError` that says what happened and what to do. A requeue
  (`--requeue`, after preemption or `scontrol requeue`) is not an end: the job starts again, its ranks resume from
  the stage's newest complete checkpoint, and the follower keeps following it.
- Stop: SIGINT/SIGTERM (a Prefect worker cancelling the flow run, Ctrl-C) -> `scancel --signal=TERM JOB`, which
  signals the job's steps and not its batch script (`--full`/`--batch` would also signal `srun`, which answers a
  SIGTERM by SIGKILLing its tasks). Each node launcher gives its ranks the stage's `stop_grace_seconds` to
  checkpoint (not Slurm's cluster-wide `KillWait`, which a plain `scancel` would impose) and exits with 128+15; the
  script then `scancel`s its own job, which Slurm accounts CANCELLED. The follower waits for that end; a job still
  running `stop_grace_seconds` + 30 s later gets a plain `scancel` (SIGKILL after KillWait). Then
  `LaunchCancelled`. A job still pending is cancelled at once. Any other exception out of the follow loop (a crash
  of the flow run) cancels the job outright. A `kill -9` of the process that follows cannot: the job then runs to
  its end by itself (its `time_limit` bounds it); one killed after the stop signal still stops gracefully.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from d9d.flows.jobs.launch import LaunchCancelled, LaunchError, LaunchSpec
from d9d.flows.jobs.launchers.base import (
    ClusterJob,
    FileFollower,
    LineCallback,
    LineSink,
    ProgressCallback,
    StopSignals,
    report_cluster_job,
)
from d9d.flows.jobs.launchers.cluster_job import ClusterJobSpec, SecretRef, render_cluster_job
from d9d.flows.jobs.launchers.config import SlurmLauncherConfig
from d9d.flows.jobs.topology import RankTopology

SCRIPT_FILE = "job.sbatch"
# States after which the job will not run again (a requeued job passes through REQUEUED/PENDING instead).
END_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY",
     "DEADLINE", "REVOKED"}
)  # fmt: skip
_COMMAND_TIMEOUT = 60.0  # a Slurm client command; the controller answers within seconds unless it is down
_STOP_MARGIN = 30.0  # after the node launchers' grace: until the batch script has cancelled its own job
_CANCEL_WAIT = 180.0  # after a plain scancel: Slurm's KillWait (30-60 s usually) and the epilog
SUBMIT_ENVIRONMENT = "submit-environment"  # a Slurm job's secrets come from there (the template needs names)


class SlurmError(LaunchError):
    """A Slurm command failed or the job ended in a state other than COMPLETED (the message says which and why)."""


@dataclass(frozen=True, kw_only=True)
class SlurmJobState:
    state: str
    exit_code: str = ""
    nodes: str = ""
    reason: str = ""
    log: str = ""


def parse_scontrol_job(text: str) -> SlurmJobState | None:
    """The fields of one job from `scontrol show job -o ID` (None when the output names no job)."""
    fields: dict[str, str] = {}
    for item in text.split():
        name, equals, value = item.partition("=")
        if equals and name not in fields:
            fields[name] = value
    if "JobState" not in fields:
        return None
    nodes = fields.get("NodeList", "")
    return SlurmJobState(
        state=fields["JobState"],
        exit_code=fields.get("ExitCode", ""),
        nodes="" if nodes == "(null)" else nodes,
        reason=fields.get("Reason", ""),
        log=fields.get("StdOut", ""),
    )


def end_state_error(job_id: str, state: SlurmJobState, *, name: str, log: str) -> SlurmError:
    """What a job that ended in `state` (not COMPLETED) tells the user: what happened and how to go on."""
    where = f"slurm job {job_id} ({name}) on {state.nodes or 'no node'}"
    resume = "running the stage again resumes from its newest complete checkpoint"
    match state.state:
        case "CANCELLED":
            what = f"was cancelled outside d9d (scancel or an administrator; reason {state.reason}); {resume}"
        case "TIMEOUT":
            what = f"reached its time limit; raise {name}.launcher.time_limit, then {resume}"
        case "PREEMPTED":
            what = f"was preempted and not requeued (requeue off, or the partition does not allow it); {resume}"
        case "NODE_FAIL" | "BOOT_FAIL":
            what = f"lost a node ({state.state}); {resume}"
        case "OUT_OF_MEMORY":
            what = f"ran out of memory; raise {name}.launcher.memory, then {resume}"
        case "FAILED":
            what = f"failed with exit code {state.exit_code} (exit:signal)"
        case other:
            what = f"ended {other} (exit code {state.exit_code}, reason {state.reason})"
    return SlurmError(f"{where} {what}; its output: {log}")


@dataclass(frozen=True)
class SlurmLauncher:
    config: SlurmLauncherConfig
    topology: RankTopology
    name: str  # the stage: the job is `d9d-<name>`

    def job_spec(self, spec: LaunchSpec) -> ClusterJobSpec:
        """The sbatch script's values for `spec`: the stage's module and arguments on `nodes` x `nproc_per_node`."""
        config = self.config
        return ClusterJobSpec(
            **config.common_job_fields(self.topology, spec),
            name=f"d9d-{self.name}",
            # On Slurm only the names matter: the script requires them from the environment that runs sbatch.
            secret_env={name: SecretRef(secret=SUBMIT_ENVIRONMENT, key=name) for name in config.secret_env},
            partition=config.partition,
            account=config.account,
            time_limit=config.time_limit,
            venv=config.venv,
            requeue=config.requeue,
        )

    def check_shared(self, path: Path) -> None:
        shared = self.config.shared_dir
        if not path.resolve().is_relative_to(shared.resolve()):
            raise SlurmError(
                f"{path} is not under {self.name}.launcher.shared_dir={shared}: the nodes would not see the job "
                f"file and checkpoints; put the workdir on the shared storage (--set workdir={shared}/...)"
            )

    def run(
        self,
        spec: LaunchSpec,
        *,
        on_progress: ProgressCallback | None = None,
        on_line: LineCallback | None = None,
        note: LineCallback | None = None,
    ) -> None:
        self.check_shared(spec.log_file)
        missing = [name for name in self.config.secret_env if not os.environ.get(name)]
        if missing:
            raise SlurmError(
                f"{self.name}.launcher.secret_env names {', '.join(missing)}, not set here; export them before "
                "running d9d (sbatch passes this environment to the job, the script never holds them)"
            )
        job = self.job_spec(spec)
        script = spec.log_file.with_name(SCRIPT_FILE)
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(render_cluster_job("slurm", job), encoding="utf-8")
        (self.config.shared_dir / "logs").mkdir(parents=True, exist_ok=True)
        say = note or (lambda message: None)
        with spec.log_file.open("a", encoding="utf-8") as log, StopSignals() as stop:
            log.write(f"$ sbatch --parsable {script}\n")
            log.flush()
            job_id = self._submit(script)
            output = self.config.shared_dir / "logs" / f"{job.name}-{job_id}.out"
            say(f"{self.name}: submitted slurm job {job_id} ({job.nodes} node(s) x {job.nproc_per_node} ranks)")
            sink = LineSink(log, on_progress, on_line)
            last = self._follow(job_id, job=job, script=script, output=output, sink=sink, stop=stop, say=say)
        if stop.stopping:
            stop.finish()  # re-raises Prefect's TerminationSignal, or hands the signal on (which may raise too)
            signum = stop.signum if stop.signum is not None else signal.SIGTERM
            raise LaunchCancelled(signum, f"slurm job {job_id} ({self.name}) cancelled; it has ended")
        if last.state != "COMPLETED":
            raise end_state_error(job_id, last, name=self.name, log=str(output))

    def _follow(
        self,
        job_id: str,
        *,
        job: ClusterJobSpec,
        script: Path,
        output: Path,
        sink: LineSink,
        stop: StopSignals,
        say: LineCallback,
    ) -> SlurmJobState:
        follower = FileFollower(output)
        shown = SlurmJobState(state="SUBMITTED")
        state = shown
        stopped_at: float | None = None  # asked to stop (SIGTERM to the steps)
        cancelled_at: float | None = None  # cancelled outright (scancel)
        next_poll = 0.0

        def poll() -> bool:
            """One look at the job (and a step of stopping it); True once it has ended."""
            nonlocal shown, state, stopped_at, cancelled_at, next_poll
            for line in follower.lines():
                sink(line)
            now = time.monotonic()
            if stop.stopping and stopped_at is None:
                say(f"{self.name}: stopping; slurm job {job_id} gets {self.config.stop_grace_seconds} s to stop")
                self._stop(job_id)
                stopped_at = now
            if stopped_at is not None and cancelled_at is None and now > stopped_at + self._stop_wait:
                say(f"{self.name}: slurm job {job_id} still {state.state} after its grace; scancel")
                self._cancel(job_id)
                cancelled_at = now
            if now >= next_poll:
                state = self._state(job_id)
                if (state.state, state.nodes) != (shown.state, shown.nodes):
                    where = f" on {state.nodes}" if state.nodes else ""
                    say(f"{self.name}: slurm job {job_id} {state.state}{where}")
                    report_cluster_job(
                        ClusterJob(
                            scheduler="slurm", job_id=job_id, name=job.name, state=state.state,
                            nodes=state.nodes or shown.nodes, log=str(output), script=str(script),
                        )
                    )  # fmt: skip
                    shown = replace(state, nodes=state.nodes or shown.nodes)
                if state.state in END_STATES:
                    return True
                next_poll = now + (1.0 if stopped_at is not None else self.config.poll_seconds)
            if cancelled_at is not None and now > cancelled_at + _CANCEL_WAIT:
                raise SlurmError(f"slurm job {job_id} is still {state.state} long after scancel; check squeue")
            return False

        ended = False
        try:
            while not ended:
                try:
                    ended = poll()
                    if not ended:
                        time.sleep(0.2)
                except BaseException as error:
                    if not stop.caught(error):
                        raise  # a crash, or a second interrupt: the job is cancelled outright below
            for line in [*follower.lines(), *follower.rest()]:
                sink(line)
        finally:
            if not ended and cancelled_at is None:
                # An exception out of the loop (the flow run crashed, a second Ctrl-C): leave no job behind.
                with contextlib.suppress(Exception):
                    self._cancel(job_id)
        return replace(state, nodes=state.nodes or shown.nodes)

    def _submit(self, script: Path) -> str:
        out = _slurm("sbatch", "--parsable", str(script))
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {out!r}, not a job id")
        return job_id

    @property
    def _stop_wait(self) -> float:
        """From the SIGTERM to the steps to a plain scancel: the node launchers' grace, then the script's own
        scancel (seconds: srun returns, the batch script runs scancel)."""
        return self.config.stop_grace_seconds + _STOP_MARGIN

    def _stop(self, job_id: str) -> None:
        """SIGTERM to the running job's steps (the node launchers take it from there); a job that is not running
        (pending, requeued) has no rank to checkpoint and is cancelled outright."""
        running = self._state(job_id).state == "RUNNING"
        if running and _slurm_result("scancel", "--signal=TERM", job_id).returncode == 0:
            return
        self._cancel(job_id)

    def _cancel(self, job_id: str) -> None:
        _slurm("scancel", job_id)

    def _state(self, job_id: str) -> SlurmJobState:
        result = _slurm_result("scontrol", "show", "job", "-o", job_id)
        if result.returncode == 0 and (state := parse_scontrol_job(result.stdout)) is not None:
            return state
        # The controller forgets a job MinJobAge seconds after it ended; accounting (if any) remembers it.
        accounting = _slurm_result("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList")
        rows = [line.split("|") for line in accounting.stdout.splitlines() if line.count("|") == 2]
        if accounting.returncode == 0 and rows:
            state_name, exit_code, nodes = rows[-1]
            return SlurmJobState(state=state_name.split()[0], exit_code=exit_code, nodes=nodes)
        raise SlurmError(
            f"slurm job {job_id} is not known to scontrol ({result.stderr.strip()}) nor to sacct "
            f"({accounting.stderr.strip() or 'no record'})"
        )


def _slurm_result(*command: str) -> subprocess.CompletedProcess[str]:
    program = shutil.which(command[0])
    if program is None:
        raise SlurmError(
            f"{command[0]} is not on PATH: the slurm launcher runs where Slurm's commands work (a login node); "
            "install slurm-client there, or choose launcher.kind=local"
        )
    try:
        return subprocess.run(
            [program, *command[1:]], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise SlurmError(f"{' '.join(command)} did not answer within {_COMMAND_TIMEOUT:.0f} s") from error


def _slurm(*command: str) -> str:
    result = _slurm_result(*command)
    if result.returncode != 0:
        raise SlurmError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def slurm_commands() -> Sequence[str]:
    """The Slurm client commands the launcher runs."""
    return ("sbatch", "scontrol", "scancel", "sacct")
