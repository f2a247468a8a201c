"""A real single-node Slurm cluster for tests: `slurmctld` and `slurmd` (Debian's `slurm-wlm`) started as
subprocesses on 127.0.0.1 with a configuration, state and spool of their own in a temporary directory.

Authentication is `auth/none` and `cred/none` (both plugins ship with Slurm 22.05), so no munge daemon and no key
are needed; the daemons listen on free ports of 127.0.0.1 only. Every Slurm command a test (or the launcher under
test) runs finds this cluster through `SLURM_CONF`. Processes are tracked with `ProctrackType=proctrack/linuxproc`
(parent-child links, no cgroups), so a cancelled job's processes are found and killed without systemd.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

KILL_WAIT_SECONDS = 5
SLURM_DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def missing_slurm() -> list[str]:
    """The Slurm programs that are not on PATH (`apt-get install slurm-wlm` installs all of them)."""
    extra = ("/usr/sbin",)
    path = os.pathsep.join([os.environ.get("PATH", ""), *extra])
    return [name for name in SLURM_DAEMONS if shutil.which(name, path=path) is None]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    root: Path
    node: str
    env: dict[str, str]  # the environment of a Slurm client of this cluster

    def run(self, *command: str, check: bool = True) -> str:
        result = subprocess.run(command, check=False, env=self.env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def job_field(self, job_id: str, field: str) -> str:
        """One field of `scontrol show job` (e.g. JobState), or "" when the controller has forgotten the job."""
        command = ("scontrol", "show", "job", "-o", job_id)
        for _ in range(10):  # a busy controller (8 test sessions on 2 cores) can time out an RPC: ask again
            result = subprocess.run(command, check=False, env=self.env, capture_output=True, text=True, timeout=60)
            if result.returncode == 0 or "Invalid job id" in result.stderr:
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        for item in result.stdout.split():
            name, _, value = item.partition("=")
            if name == field:
                return value
        return ""


def _slurm_conf(root: Path, node: str, cpus: int, memory_mb: int) -> str:
    return "\n".join(
        [
            "ClusterName=d9dtest",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={root}/jobcomp.log",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            # From a plain scancel's (or a requeue's) SIGTERM to its SIGKILL. Short, so that a test tells it from the
            # stage's own stop_grace_seconds, which d9d's cancellation gives the ranks instead.
            f"KillWait={KILL_WAIT_SECONDS}",
            "MinJobAge=600",
            "InactiveLimit=0",
            "SlurmdTimeout=120",
            # A requeued job may start again at once (the default holds it back for a while).
            "JobRequeue=1",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]
    )


@contextmanager
def slurm_cluster(root: Path, *, cpus: int | None = None, timeout: float = 120.0) -> Iterator[SlurmCluster]:
    """Start slurmctld and slurmd on this machine, wait until the node is idle, stop both at the end."""
    node = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 2
    for folder in ("state", "spool", "logs"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, cpus, memory_mb=1024), encoding="utf-8")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin"])
    cluster = SlurmCluster(conf=conf, root=root, node=node, env=env)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            # -D: stay in the foreground (a child of the test); -i: ignore state left by an earlier start.
            flags = ["-D", "-i"] if daemon == "slurmctld" else ["-D"]
            daemons.append(
                subprocess.Popen(
                    [shutil.which(daemon, path=env["PATH"]) or daemon, *flags, "-f", str(conf)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=(root / f"{daemon}.stderr").open("wb"),
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for process in daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited with {process.returncode}; {_logs(root)}")
            state = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).strip()
            if state.startswith("idle"):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the Slurm node is {state or 'not known'} after {timeout} s; {_logs(root)}")
        yield cluster
    finally:
        if daemons:
            subprocess.run(
                ["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=60, check=False
            )
        for process in reversed(daemons):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _logs(root: Path) -> str:
    parts = []
    for name in ("slurmctld.log", "slurmd.log", "slurmctld.stderr", "slurmd.stderr"):
        path = root / name
        if path.is_file():
            parts.append(f"{name}: {path.read_text(errors='replace')[-1500:]}")
    return "\n".join(parts)
