"""The `slurm` launcher against a real single-node Slurm (Debian's `slurm-wlm`: slurmctld and slurmd started by the
fixture on 127.0.0.1, see `slurm_cluster.py`) and a real Prefect server (`d9d server start`, see `prefect_server.py`):
the micro pipeline's pretrain stage, configured with `launcher.kind: slurm`, runs as a Slurm job of one node x 2 CPU
ranks.

- deployed (`d9d deploy`, a process worker, runs triggered through the API), it completes: the flow run ends
  Completed, the job COMPLETED, and the stage's output, launch log and the job's artifact are there;
- cancelling the deployed flow run through the API (state Cancelling, as the UI and `prefect flow-run cancel` do)
  cancels the Slurm job, which ends CANCELLED with no rank program, srun or slurmstepd of it left running, and the
  flow run ends Cancelled;
- the stage's `stop_grace_seconds` is what the ranks get to stop, not Slurm's KillWait (5 s here) nor torchrun's
  30 s: ranks that take 35 s to "checkpoint" finish;
- `scontrol requeue` of the running job (what preemption does) restarts it; it resumes from the newest complete
  checkpoint and ends with the same final model, bit for bit, as the undisturbed run (`d9d run`, against the same
  server).

Skipped where slurmctld/slurmd are not installed, except under CI=true (CI installs them: .ci/run): then it fails.
Isolated: Prefect starts threads. About 4 minutes on the 2-core machine when it is quiet, 7 under load.
"""

from __future__ import annotations

import os
import re
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
import yaml
from prefect_server import Server, flow_run_state, prefect_server, start_worker, stop_worker
from slurm_cluster import KILL_WAIT_SECONDS, SlurmCluster, missing_slurm, slurm_cluster
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from d9d.core.checkpoint import latest_complete
from d9d.flows.cli import main
from d9d.flows.jobs.contract import StageManifest
from d9d.flows.jobs.data_prep import prepare_data
from d9d.flows.jobs.launch import LaunchCancelled, LaunchSpec
from d9d.flows.jobs.launchers.config import SlurmLauncherConfig
from d9d.flows.jobs.launchers.slurm import SlurmLauncher
from d9d.flows.jobs.loading import load_job_config
from d9d.flows.jobs.topology import RankTopology

pytestmark = pytest.mark.isolated
HERE = Path(__file__).resolve().parent
PROGRAM = "d9d.flows.jobs.pretrain.program"
JOB_NAME = "d9d-pretrain"
POOL = "slurm-test"
STOP_SECONDS = 35  # a rank's stand-in checkpoint: longer than KillWait (5 s) and torchrun's own 30 s


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


def _settings(workdir: Path, output: str, *, steps: int = 8) -> list[str]:
    """The job's `--set` values: micro pretrain of `steps` steps into `output`, on Slurm (shared storage: `workdir`)."""
    return [
        f"workdir={workdir / 'run'}",
        f"pretrain.output={workdir / 'run' / output}",
        "pretrain.init_from=random",
        f"pretrain.steps={steps}",
        "pretrain.checkpoint_every=2",
        "pretrain.keep_last=8",
        "pretrain.launcher.kind=slurm",
        f"pretrain.launcher.shared_dir={workdir}",
        "pretrain.launcher.poll_seconds=0.5",
        "pretrain.launcher.stop_grace_seconds=20",  # within the 30 s a Prefect worker waits for a cancelled run
        f"pretrain.launcher.rdzv_port={_free_port()}",
    ]


def _argv(workdir: Path, output: str) -> list[str]:
    argv = ["run", "pretrain", "--preset", "micro"]
    for setting in _settings(workdir, output):
        argv += ["--set", setting]
    return argv


@pytest.fixture(scope="module")
def server(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A Prefect server for the module; its clients (this process, the worker, flow runs) see SLURM_CONF."""
    with prefect_server(tmp_path_factory.mktemp("d9d-server-home")) as running:
        assert running.env["SLURM_CONF"] == str(slurm.conf)
        yield running


@pytest.fixture(scope="module")
def deployed(server: Server, workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`d9d deploy` of two pretrain deployments on Slurm (8 steps; 400, far longer than a test waits) on a process
    work pool, and a worker that takes their runs for the whole module. Yields where the worker logs."""
    folder = tmp_path_factory.mktemp("deploy")
    deployments = [
        {"name": name, "flow": "pretrain", "job": {"preset": "micro", "set": settings}, "work_pool": {"name": POOL}}
        for name, settings in (
            ("slurm-pretrain", _settings(workdir, "pretrain-slurm")),
            ("slurm-pretrain-long", _settings(workdir, "pretrain-cancelled", steps=400)),
        )
    ]
    path = folder / "prefect.yaml"
    path.write_text(yaml.safe_dump({"work_pools": [{"name": POOL}], "deployments": deployments}), encoding="utf-8")
    assert main(["deploy", "--file", str(path)]) == 0
    worker = start_worker(server, POOL, folder, run_once=False)
    try:
        yield folder / f"worker-{POOL}.log"
    finally:
        stop_worker(worker)


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


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Everything of Slurm job `job_id` on this node: its slurmstepd's (`slurmstepd: [ID.batch]`, `[ID.0]`) and every
    process they started (the batch script, srun, the node launcher, torchrun, the ranks: SLURM_JOB_ID=ID)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if f"[{job_id}." in " ".join(proc.info["cmdline"] or []) or proc.environ().get("SLURM_JOB_ID") == job_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _run_deployment(name: str, timeout: float) -> Any:
    from prefect.deployments import run_deployment

    return run_deployment(name, timeout=timeout)


@pytest.fixture(scope="module")
def undisturbed(deployed: Path, slurm: SlurmCluster, workdir: Path) -> Path:
    """The 8-step deployment run to its end through the worker; the output it left."""
    flow_run = _run_deployment("pretrain/slurm-pretrain", timeout=600)
    assert flow_run.state is not None and flow_run.state.is_completed(), (
        f"{flow_run.state}: {deployed.read_text()[-3000:]}"
    )
    return workdir / "run" / "pretrain-slurm"


def test_the_deployed_pretrain_runs_as_a_slurm_job_and_completes(
    undisturbed: Path, slurm: SlurmCluster, workdir: Path
) -> None:
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


def test_cancelling_the_deployed_flow_run_cancels_the_slurm_job_and_leaves_no_process(
    undisturbed: Path, deployed: Path, slurm: SlurmCluster, workdir: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    partial = workdir / "run" / ".pretrain-cancelled.partial"
    before = _job_ids(workdir)
    flow_run = _run_deployment("pretrain/slurm-pretrain-long", timeout=0)
    seen: dict[int, psutil.Process] = {}
    ranks_seen: set[int] = set()

    def training() -> bool:
        ranks = _rank_programs(partial)
        ranks_seen.update(proc.pid for proc in ranks)
        seen.update({proc.pid: proc for proc in ranks})
        running = _job(slurm)[1] == "RUNNING" and latest_complete(partial / "checkpoints") is not None
        assert not flow_run_state(flow_run.id).is_final(), deployed.read_text()[-3000:]
        return running

    _when(training, 300, "training under Slurm with a checkpoint")
    job_id = _job(slurm)[0]
    assert job_id not in before
    seen.update({proc.pid: proc for proc in _job_processes(job_id)})
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Cancelling())  # what the UI's Cancel and `prefect flow-run cancel` do
    _when(lambda: flow_run_state(flow_run.id).is_final(), 180, "a final flow run state after the cancellation")

    state = flow_run_state(flow_run.id)
    assert state.type == StateType.CANCELLED, f"{state}: {deployed.read_text()[-3000:]}"
    assert slurm.job_field(job_id, "JobState") == "CANCELLED"
    assert len(ranks_seen) >= 3, ranks_seen  # the node launcher, torchrun and 2 ranks were seen running
    _, alive = psutil.wait_procs(list(seen.values()), timeout=30)
    assert not alive, [" ".join(proc.cmdline()) for proc in alive]
    _when(lambda: not _job_processes(job_id), 30, f"every process of job {job_id} gone")
    assert not _rank_programs(partial)
    assert latest_complete(partial / "checkpoints") is not None  # the ranks stopped at a complete checkpoint
    assert not (workdir / "run" / "pretrain-cancelled").exists()


def test_the_ranks_get_the_stages_stop_grace_not_slurms_kill_wait(
    slurm: SlurmCluster, workdir: Path, tmp_path: Path
) -> None:
    """`launch_rank_program slow-stop`: on SIGTERM each rank takes STOP_SECONDS to "checkpoint", then writes
    rank-R.stopped. A plain scancel would SIGKILL it after KillWait; torchrun would after 30 s."""
    assert KILL_WAIT_SECONDS < 30 < STOP_SECONDS
    out = workdir / "grace"
    out.mkdir()
    config = SlurmLauncherConfig(
        shared_dir=workdir,
        poll_seconds=0.5,
        stop_grace_seconds=STOP_SECONDS + 25,
        rdzv_port=_free_port(),
        env={
            "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}",
            "D9D_TEST_STOP_SECONDS": str(STOP_SECONDS),
        },
    )
    launcher = SlurmLauncher(config, RankTopology(nproc_per_node=2, device="cpu"), "grace")
    spec = LaunchSpec(
        module="launch_rank_program", args=[str(out), "slow-stop"], nproc_per_node=2, log_file=out / "launch.log"
    )
    notes: list[str] = []
    stopped_at: list[float] = []

    def stop_once_running() -> None:
        _when(lambda: len(list(out.glob("rank-*.pid"))) == 2, 120, "both ranks running")
        stopped_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)  # what a Prefect worker sends the flow-run process it cancels

    thread, errors = _in_background(stop_once_running)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the launcher hands the signal on to this
    try:
        with pytest.raises(LaunchCancelled):
            launcher.run(spec, note=notes.append)
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.monotonic() - stopped_at[0]
    thread.join(timeout=10)
    assert not errors, errors
    (job_id,) = [match.group(1) for note in notes if (match := re.search(r"submitted slurm job (\d+)", note))]
    assert sorted(path.name for path in out.glob("rank-*.stopped")) == ["rank-0.stopped", "rank-1.stopped"]
    assert STOP_SECONDS <= seconds < config.stop_grace_seconds, (seconds, notes)
    assert slurm.job_field(job_id, "JobState") == "CANCELLED", notes
    _when(lambda: not _job_processes(job_id), 30, f"every process of job {job_id} gone")


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
