"""A real Prefect server for tests: `d9d server start` on a free port of 127.0.0.1 (SQLite in a temporary D9D_HOME;
healthy after 10-25 s on the 2-core machine), this process made its client, and process workers that take a work
pool's flow runs. Used by the `d9d deploy`/`d9d serve` tests and the Slurm launcher's deployed-flow tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.flows.deployments.server import wait_until_healthy


@dataclass(frozen=True)
class Server:
    api_url: str
    env: dict[str, str]  # what a worker, runner or `d9d` subprocess on this machine gets
    log: Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def prefect_server(home: Path) -> Iterator[Server]:
    """Start the server with its home in `home`; within the block this process is its client (PREFECT_API_URL)."""
    log = home / "server.log"
    port = _free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env.update({"D9D_HOME": str(home), "OMP_NUM_THREADS": "1"})
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "d9d.flows.cli", "server", "start", "--port", str(port), "--no-ui"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    api_url = f"http://127.0.0.1:{port}/api"
    saved = dict(os.environ)
    try:
        wait_until_healthy(api_url, timeout_seconds=180)
        client_env = {**env, "PREFECT_API_URL": api_url}
        os.environ.clear()
        os.environ.update(client_env)
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

        # Prefect reads its settings once, at import; an earlier test may have imported it for the embedded API.
        with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_SERVER_EPHEMERAL_ENABLED: False}):
            yield Server(api_url=api_url, env=client_env, log=log)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_worker(server: Server, pool: str, cwd: Path, *, run_once: bool = True) -> subprocess.Popen[bytes]:
    """A process worker on `pool` (its log: `cwd/worker-POOL.log`). `run_once`: it takes the pool's due runs, waits
    for them to finish and exits; otherwise it runs until stopped (`stop_worker`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, *(["--run-once"] if run_once else [])],
        env=server.env,
        cwd=cwd,
        stdout=(cwd / f"worker-{pool}.log").open("w"),
        stderr=subprocess.STDOUT,
    )


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def flow_run_state(flow_run_id: Any) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state
