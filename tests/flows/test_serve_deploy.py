"""`d9d server start`, `d9d deploy` and `d9d serve` against a real Prefect server on 127.0.0.1.

One server per module (`prefect_server.py`), started with `d9d server start` (SQLite in a temporary D9D_HOME;
healthy after 10-25 s on the 2-core machine). Flow runs execute in real subprocesses: a `prefect worker start
--run-once` process worker for deployments on a work pool, or the `d9d serve` runner. Marked `isolated`: Prefect
starts threads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from prefect_server import Server, flow_run_state, prefect_server, start_worker

from d9d.flows.cli import main
from d9d.flows.deployments.config import DeployConfigError, load_deploy_file
from d9d.flows.deployments.server import plan_server

pytestmark = pytest.mark.isolated

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN_PROGRAM = "d9d.flows.jobs.pretrain.program"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with prefect_server(tmp_path_factory.mktemp("d9d-server-home")) as running:
        yield running


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# Config and commands that fail before touching Prefect -----------------------------------------------------------


def test_a_bad_cron_string_names_the_deployment_the_value_and_the_form(tmp_path):
    path = _write(
        tmp_path / "prefect.yaml",
        {"deployments": [{"name": "nightly", "flow": "convert", "schedules": [{"cron": "0 25 * * *"}]}]},
    )
    with pytest.raises(DeployConfigError) as caught:
        load_deploy_file(path)
    message = str(caught.value)
    assert "deployments.0.schedules.0" in message
    assert "cron='0 25 * * *'" in message
    assert "five fields" in message

    schedule = {"cron": "0 2 * * *", "timezone": "Mars/Olympus"}
    _write(path, {"deployments": [{"name": "n", "flow": "convert", "schedules": [schedule]}]})
    with pytest.raises(DeployConfigError, match="timezone='Mars/Olympus'"):
        load_deploy_file(path)


def test_unknown_keys_flows_and_deployment_names_are_rejected_with_the_valid_ones(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path / "a.yaml", {"deployments": [{"name": "n", "flow": "convert", "schedule": "daily"}]})
    with pytest.raises(DeployConfigError, match=r"deployments\.0\.schedule = 'daily': Extra inputs"):
        load_deploy_file(path)

    from d9d.flows.deployments.build import runner_deployment

    entry = load_deploy_file(_write(tmp_path / "b.yaml", {"deployments": [{"name": "n", "flow": "train"}]}))
    with pytest.raises(
        DeployConfigError, match="flow = 'train' is not a d9d flow; valid: pipeline, data-prep, finetune-data, convert"
    ):
        runner_deployment(entry.deployments[0], with_work_pool=False)
    with pytest.raises(DeployConfigError, match="has no work_pool"):
        runner_deployment(entry.deployments[0].model_copy(update={"flow": "convert"}), with_work_pool=True)

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never contacted: the name check comes first
    assert main(["deploy", "--file", str(tmp_path / "b.yaml"), "--deployment", "weekly"]) == 2
    assert "no deployment named 'weekly' in the file; deployments: n" in capsys.readouterr().err


def test_deploy_and_serve_refuse_the_embedded_api(tmp_path, capsys):
    path = _write(tmp_path / "prefect.yaml", {"deployments": [{"name": "n", "flow": "convert"}]})
    saved = dict(os.environ)
    try:
        for name in [name for name in os.environ if name.startswith("PREFECT_")]:
            del os.environ[name]
        os.environ["D9D_HOME"] = str(tmp_path / "home")
        os.environ["PREFECT_PROFILES_PATH"] = str(tmp_path / "no-profiles.toml")
        for command in ("deploy", "serve"):
            assert main([command, "--file", str(path)]) == 2
            assert f"`d9d {command}` needs a Prefect server" in capsys.readouterr().err
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_server_plan_uses_its_own_sqlite_home_or_the_postgres_url_given(tmp_path):
    environ = {"D9D_HOME": str(tmp_path), "PREFECT_API_URL": "http://elsewhere/api"}
    plan = plan_server(host="0.0.0.0", port=4200, database_url=None, ui=False, environ=environ, behind_auth_proxy=True)
    assert plan.argv[1:] == ["-m", "prefect", "server", "start", "--host", "0.0.0.0", "--port", "4200"]
    assert plan.environ["PREFECT_HOME"] == str(tmp_path / "server")
    assert "PREFECT_API_URL" not in plan.environ  # the server must not act as a client of another API
    assert plan.environ["PREFECT_UI_ENABLED"] == "false"
    assert plan.api_url == "http://127.0.0.1:4200/api"
    assert plan.database == f"SQLite at {tmp_path / 'server' / 'prefect.db'}"

    url = "postgresql+asyncpg://prefect:s3cret@db.internal:5432/prefect"
    plan = plan_server(host="127.0.0.1", port=4200, database_url=url, ui=True, environ=environ)
    assert plan.environ["PREFECT_API_DATABASE_CONNECTION_URL"] == url
    assert plan.database == "postgresql+asyncpg://prefect:***@db.internal:5432/prefect"  # never print the password
    with pytest.raises(ValueError, match="--database-url 'mysql://x' is not a database Prefect can use"):
        plan_server(host="127.0.0.1", port=4200, database_url="mysql://x", ui=True, environ=environ)
    with pytest.raises(ValueError, match=r"'mysql://root:\*\*\*@db/prefect' is not a database") as error:
        plan_server(host="127.0.0.1", port=4200, database_url="mysql://root:s3cret@db/prefect", ui=True, environ={})
    assert "s3cret" not in str(error.value)  # the error path redacts the password too
    with pytest.raises(ValueError, match="--port 70000 is not a TCP port"):
        plan_server(host="127.0.0.1", port=70000, database_url=None, ui=True, environ=environ)


def test_the_repository_deployment_file_is_valid_and_every_entry_builds():
    from d9d.flows.deployments.build import runner_deployment

    deploy_file = load_deploy_file(ROOT / "infra" / "prefect.yaml")
    assert deploy_file.deployments, "infra/prefect.yaml declares no deployments"
    for entry in deploy_file.deployments:
        deployment = runner_deployment(entry, with_work_pool=True)
        assert deployment.entrypoint and deployment.entrypoint.startswith("d9d.flows.")
        assert deployment.schedules, f"{entry.name} has no schedule"


# Against the real server ----------------------------------------------------------------------------------------


def test_deploy_creates_pool_limits_and_a_cron_deployment_that_a_process_worker_completes(server, tmp_path, capsys):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    workdir = tmp_path / "work"
    path = _write(
        tmp_path / "prefect.yaml",
        {
            "work_pools": [
                {"name": "local-test", "concurrency_limit": 1, "job_variables": {"env": {"OMP_NUM_THREADS": "1"}}}
            ],
            "concurrency_limits": [{"name": "gpus-test", "limit": 8}],
            "deployments": [
                {
                    "name": "nightly-convert",
                    "flow": "convert",
                    "job": {"preset": "micro", "set": [f"workdir={workdir}"]},
                    "schedules": [{"cron": "0 3 * * *", "timezone": "Europe/Berlin"}],
                    "work_pool": {"name": "local-test"},
                    "concurrency_limit": 1,
                    "tags": ["d9d-test"],
                }
            ],
        },
    )
    assert main(["deploy", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert "work pool local-test (process, created; concurrency 1)" in out
    assert "deployment convert/nightly-convert on pool local-test: cron '0 3 * * *' (Europe/Berlin)" in out

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("local-test")
        assert (pool.type, pool.concurrency_limit) == ("process", 1)
        assert pool.base_job_template["variables"]["properties"]["env"]["default"] == {"OMP_NUM_THREADS": "1"}
        assert client.read_global_concurrency_limit_by_name("gpus-test").limit == 8
        deployment = client.read_deployment_by_name("convert/nightly-convert")
        assert deployment.entrypoint == "d9d.flows.stage_flow.convert_flow"
        assert deployment.work_pool_name == "local-test"
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in deployment.schedules] == [
            ("0 3 * * *", "Europe/Berlin", True)
        ]
        assert deployment.parameters["job"]["workdir"] == str(workdir)
        assert deployment.global_concurrency_limit is not None
        assert deployment.global_concurrency_limit.limit == 1

    # Applying the same file again updates in place (same deployment id, the pool is reported as updated).
    assert main(["deploy", "--file", str(path)]) == 0
    assert "local-test (process, updated" in capsys.readouterr().out
    with get_client(sync_client=True) as client:
        assert client.read_deployment_by_name("convert/nightly-convert").id == deployment.id

    started = time.monotonic()
    flow_run = run_deployment("convert/nightly-convert", timeout=0)
    worker = start_worker(server, "local-test", tmp_path)
    assert worker.wait(timeout=300) == 0, (tmp_path / "worker-local-test.log").read_text()
    state = flow_run_state(flow_run.id)
    assert state.is_completed(), f"{state}: {(tmp_path / 'worker-local-test.log').read_text()[-3000:]}"
    manifest = json.loads((workdir / "model" / "manifest.json").read_text())
    assert manifest["stage"] == "convert"
    print(f"deployment run through a process worker: {time.monotonic() - started:.1f} s")


def test_serve_serves_the_schedule_runs_a_triggered_run_and_pauses_on_stop(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    workdir = tmp_path / "work"
    path = _write(
        tmp_path / "prefect.yaml",
        {
            "deployments": [
                {
                    "name": "served-convert",
                    "flow": "convert",
                    "job": {"preset": "micro", "set": [f"workdir={workdir}"]},
                    "schedules": [{"cron": "30 4 * * 1"}],
                }
            ]
        },
    )
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "d9d.flows.cli", "serve", "--file", str(path)],
        env=server.env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deployment = None
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            while deployment is None and time.monotonic() < deadline:
                assert serve.poll() is None, (tmp_path / "serve.log").read_text()
                try:
                    deployment = client.read_deployment_by_name("convert/served-convert")
                except Exception:  # not created yet
                    time.sleep(0.5)
        assert deployment is not None, (tmp_path / "serve.log").read_text()
        assert [s.schedule.cron for s in deployment.schedules] == ["30 4 * * 1"]
        assert deployment.work_pool_name is None  # the runner is the infrastructure

        flow_run = run_deployment("convert/served-convert", timeout=240)
        assert flow_run.state is not None and flow_run.state.is_completed(), (tmp_path / "serve.log").read_text()
        assert (workdir / "model" / "manifest.json").is_file()
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
        log.close()
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("convert/served-convert")
        assert deployment.paused  # a stopped runner pauses what it served: no scheduled runs pile up


# Cancelling a running pretrain deployment run ----------------------------------------------------------------------


def _rank_processes(workdir: Path) -> list[psutil.Process]:
    """torchrun and rank processes of the pretrain program for jobs under `workdir` (other tests' are ignored)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if PRETRAIN_PROGRAM in cmdline and str(workdir) in cmdline:
            found.append(process)
    return found


def _load_checkpoint_model(checkpoint: Path) -> int:
    """Load every model tensor of a DCP checkpoint in this process; returns how many were read."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    tensors = {
        key: torch.full(item.size, float("nan"), dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata) and key.startswith("app.model.")
    }
    dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=True)
    assert all(torch.isfinite(tensor).all() for tensor in tensors.values())
    return len(tensors)


def test_cancelling_a_running_pretrain_deployment_run_leaves_no_rank_and_a_complete_checkpoint(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from d9d.core.checkpoint import latest_complete

    workdir = tmp_path / "work"
    job_set = [f"workdir={workdir}", "pretrain.steps=5000", "pretrain.checkpoint_every=2", "pretrain.grace_seconds=25"]
    assert main(["run", "data-prep", "--preset", "micro", "--set", f"workdir={workdir}"]) == 0
    path = _write(
        tmp_path / "prefect.yaml",
        {
            "work_pools": [{"name": "pretrain-test"}],
            "deployments": [
                {
                    "name": "long",
                    "flow": "pretrain",
                    "job": {"preset": "micro", "set": job_set},
                    "work_pool": {"name": "pretrain-test"},
                }
            ],
        },
    )
    assert main(["deploy", "--file", str(path)]) == 0
    flow_run = run_deployment("pretrain/long", timeout=0)
    worker = start_worker(server, "pretrain-test", tmp_path)
    checkpoints = workdir / ".pretrain.partial" / "checkpoints"
    deadline = time.monotonic() + 240
    while latest_complete(checkpoints) is None:
        assert time.monotonic() < deadline, (tmp_path / "worker-pretrain-test.log").read_text()[-3000:]
        assert worker.poll() is None, (tmp_path / "worker-pretrain-test.log").read_text()[-3000:]
        time.sleep(0.5)
    assert len(_rank_processes(workdir)) >= 3  # torchrun and its 2 ranks are running

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Cancelling())
    assert worker.wait(timeout=180) == 0
    state = flow_run_state(flow_run.id)
    # The worker stops the flow-run process with SIGTERM. Prefect's engine reports the run CANCELLED only if its own
    # SIGTERM handler is installed when the cancel intent arrives (else CRASHED, "aborted by a termination
    # signal"): the local launcher leaves it in place and stops the ranks when it raises.
    assert state.type == StateType.CANCELLED, state
    with get_client(sync_client=True) as client:
        history = [item.type for item in client.read_flow_run_states(flow_run.id)]
    assert StateType.CANCELLING in history, history
    assert StateType.CRASHED not in history, history  # the engine handled the stop as the cancellation it was

    survivors = _rank_processes(workdir)
    assert not survivors, [" ".join(process.cmdline()) for process in survivors]
    newest = latest_complete(checkpoints)
    assert newest is not None
    state_file = json.loads((newest / "trainer_state.json").read_text())
    assert state_file["step"] == int(newest.name.removeprefix("step-"))
    assert _load_checkpoint_model(newest) > 0
