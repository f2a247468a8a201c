"""The `slurm` launcher against a real single-node Slurm (Debian's `slurm-wlm`: slurmctld and slurmd started by the
fixture on 127.0.0.1, see `slurm_cluster.py`): the micro pipeline's pretrain stage runs through the stage's Prefect
flow (`d9d run pretrain`, embedded API) as a Slurm job of one node x 2 CPU ranks.

- it completes, and the stage's output, launch log and the job's artifact are there;
- a stop of the flow run (SIGTERM: what a Prefect worker sends a flow-run process it cancels) cancels the Slurm job,
  which ends CANCELLED, with no rank program left running;
- `scontrol requeue` of the running job (what preemption does) restarts it; it resumes from the newest complete
  checkpoint and ends with the same final model, bit for bit, as the undisturbed run.

Skipped where slurmctld/slurmd are not installed, except under CI=true (CI installs them: .ci/run): then it fails.
Isolated: Prefect starts threads. About 3-4 minutes on the 2-core machine.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from slurm_cluster import SlurmCluster, missing_slurm, slurm_cluster
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from d9d.core.checkpoint import latest_complete
from d9d.flows.cli import EXIT_TERMINATED, main
from d9d.flows.jobs.contract import StageManifest
from d9d.flows.jobs.data_prep import prepare_data
from d9d.flows.jobs.loading import load_job_config

pytestmark = pytest.mark.isolated
PROGRAM = "d9d.flows.jobs.pretrain.program"
JOB_NAME = "d9d-pretrain"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = missing_slurm()
    if missing:
        reason = f"Slurm is not installed ({', '.join(missing)} not found; apt-get install slurm-wlm)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI must run the Slurm tests (.ci/run installs slurm-wlm)")
        pytest.skip(reason)
    saved = os.environ.get("SLURM_CONF")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        os.environ["SLURM_CONF"] = str(cluster.conf)  # the launcher's sbatch/scontrol/scancel find it here
        try:
            yield cluster
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


@pytest.fixture(scope="module")
def workdir(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared storage (here a local directory: one node) with the micro job's prepared data in it."""
    shared = tmp_path_factory.mktemp("shared")
    config = load_job_config(preset_name="micro", overrides=[f"workdir={shared / 'run'}"])
    prepare_data(config.data_prep, config.data_prep_output)
    return shared


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _argv(workdir: Path, output: str) -> list[str]:
    return [
        "run", "pretrain", "--preset", "micro",
        "--set", f"workdir={workdir / 'run'}",
        "--set", f"pretrain.output={workdir / 'run' / output}",
        "--set", "pretrain.init_from=random",
        "--set", "pretrain.steps=8",
        "--set", "pretrain.checkpoint_every=2",
        "--set", "pretrain.keep_last=8",
        "--set", "pretrain.launcher.kind=slurm",
        "--set", f"pretrain.launcher.shared_dir={workdir}",
        "--set", "pretrain.launcher.poll_seconds=0.5",
        "--set", "pretrain.launcher.stop_grace_seconds=30",
        "--set", f"pretrain.launcher.rdzv_port={_free_port()}",
    ]  # fmt: skip


def _job(slurm: SlurmCluster) -> tuple[str, str]:
    """(id, state) of the newest d9d-pretrain job, ("", "") before there is one."""
    rows = slurm.run("squeue", "-h", "--name", JOB_NAME, "-o", "%i %T", check=False).split()
    return (rows[-2], rows[-1]) if len(rows) >= 2 else ("", "")


def _job_ids(workdir: Path) -> set[str]:
    """The ids of the jobs that wrote an output file (`<name>-<id>.out`) on the shared storage."""
    return {path.stem.rsplit("-", 1)[1] for path in (workdir / "logs").glob(f"{JOB_NAME}-*.out")}


def _when(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        time.sleep(0.2)


def _in_background(action: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as error:  # reported by the test
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _rank_programs(output: Path) -> list[psutil.Process]:
    """Processes of this run's rank program (torchrun, its ranks, the node launcher): found by the job file."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        if PROGRAM in command and str(output) in command:
            found.append(proc)
    return found


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _final_state(output: Path, scratch: Path) -> dict[str, Any]:
    """The final checkpoint's whole state (model, optimizer, data position), read from its DCP files."""
    newest = latest_complete(output / "checkpoints")
    assert newest is not None and newest.name == "step-00000008", newest
    single = scratch / f"{output.name}.pt"
    dcp_to_torch_save(newest, single)
    state = _flat(torch.load(single, weights_only=False))
    assert any(torch.is_tensor(value) for value in state.values()), f"no tensor in {newest}"
    return state


@pytest.fixture(scope="module")
def undisturbed(prefect_api: object, slurm: SlurmCluster, workdir: Path) -> Path:
    output = workdir / "run" / "pretrain-slurm"
    assert main(_argv(workdir, output.name)) == 0
    return output


def test_pretrain_runs_as_a_slurm_job_and_completes(undisturbed: Path, slurm: SlurmCluster, workdir: Path) -> None:
    statistics = StageManifest.read(undisturbed).statistics
    assert statistics["steps"] == 8 and statistics["ranks"] == 2
    logs = sorted((workdir / "logs").glob(f"{JOB_NAME}-*.out"))
    assert logs, "the job wrote no output file"
    job_id = logs[0].stem.rsplit("-", 1)[1]
    assert slurm.job_field(job_id, "JobState") == "COMPLETED"
    assert slurm.job_field(job_id, "NodeList") == slurm.node
    launch_log = (undisturbed / "launch.log").read_text()
    assert "sbatch --parsable" in launch_log and "Traceback" not in launch_log
    assert "d9d-progress" not in launch_log  # progress records went to the stage's progress, not into the log


def test_stopping_the_flow_run_cancels_the_slurm_job(prefect_api: object, slurm: SlurmCluster, workdir: Path) -> None:
    output = workdir / "run" / "pretrain-cancelled"
    partial = workdir / "run" / ".pretrain-cancelled.partial"
    argv = _argv(workdir, output.name)
    argv[argv.index("pretrain.steps=8")] = "pretrain.steps=400"  # far longer than the test waits
    seen: dict[int, psutil.Process] = {}

    def stop_once_training() -> None:
        def training() -> bool:
            seen.update({proc.pid: proc for proc in _rank_programs(partial)})
            return _job(slurm)[1] == "RUNNING" and latest_complete(partial / "checkpoints") is not None

        _when(training, 300, "training under Slurm with a checkpoint")
        os.kill(os.getpid(), signal.SIGTERM)  # what a Prefect worker sends the flow-run process it cancels

    thread, errors = _in_background(stop_once_training)
    before = _job_ids(workdir)
    assert main(argv) == EXIT_TERMINATED
    thread.join(timeout=10)
    assert not errors, errors
    (job_id,) = _job_ids(workdir) - before
    assert slurm.job_field(job_id, "JobState") == "CANCELLED"
    assert len(seen) >= 3, seen  # the node launcher, torchrun and 2 ranks were seen running
    _, alive = psutil.wait_procs(list(seen.values()), timeout=10)
    assert not alive and not _rank_programs(partial), "a process of the cancelled job is still running"
    assert not output.exists()


def test_a_requeued_job_resumes_and_ends_with_the_undisturbed_model(
    undisturbed: Path, slurm: SlurmCluster, workdir: Path, tmp_path: Path
) -> None:
    output = workdir / "run" / "pretrain-requeued"
    partial = workdir / "run" / ".pretrain-requeued.partial"
    requeued: list[str] = []

    def preempt_after_first_checkpoint() -> None:
        def checkpointed() -> bool:
            return _job(slurm)[1] == "RUNNING" and latest_complete(partial / "checkpoints") is not None

        _when(checkpointed, 300, "running with a complete checkpoint")
        job_id = _job(slurm)[0]
        slurm.run("scontrol", "requeue", job_id)
        requeued.append(job_id)
        # Slurm holds a requeued job back for two minutes (its BeginTime); an administrator, or this test, may not wait.
        _when(lambda: _job(slurm)[1] == "PENDING", 120, "pending again after the requeue")
        slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    thread, errors = _in_background(preempt_after_first_checkpoint)
    assert main(_argv(workdir, output.name)) == 0
    thread.join(timeout=10)
    assert not errors, errors
    assert requeued and slurm.job_field(requeued[0], "Restarts") == "1"
    statistics = StageManifest.read(output).statistics
    assert statistics["resumed_from"] is not None, "the requeued job started from scratch"
    assert statistics["final_loss"] == StageManifest.read(undisturbed).statistics["final_loss"]
    expected, got = _final_state(undisturbed, tmp_path), _final_state(output, tmp_path)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        # Bit for bit: the same ranks, data order and seeds; resuming restores the model, optimizer and data state.
        assert torch.equal(value, got[name]) if torch.is_tensor(value) else value == got[name], name
