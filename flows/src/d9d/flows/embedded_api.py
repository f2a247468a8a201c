"""The embedded Prefect API as d9d runs it: a local server that no terminal signal reaches and that never outlives
the process that started it.

Prefect's own ephemeral server is a plain child of the calling process: Ctrl-C on the terminal (SIGINT to the whole
foreground process group) stopped it before the flow could report the interruption, so the run hung for minutes in
connection errors; and after `kill -9` of the caller it kept listening for good. d9d starts the same server (uvicorn
on Prefect's app factory, SQLite in the d9d home) itself instead:

- in a session of its own, so terminal signals reach only `d9d`, which stops the ranks, reports and exits;
- under `parent_death`, so the kernel sends it SIGTERM when its parent dies, however it dies;
- once per process, stopped at exit; the flows reach it through Prefect's `PREFECT_API_URL` setting.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from d9d.flows.deployments.server import wait_until_healthy
from d9d.flows.jobs.parent_death import guarded_command

_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
LOG_FILE = "embedded-server.log"


class EmbeddedApi:
    """One local Prefect server process on a free loopback port, logging into `home/embedded-server.log`."""

    def __init__(self, home: Path, *, startup_timeout: float) -> None:
        self._home = home
        self._timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.api_url = ""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> str:
        """Start the server and wait until it answers; returns its API URL."""
        import prefect

        port = _free_port()
        command = [
            sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on",
        ]  # fmt: skip
        self._home.mkdir(parents=True, exist_ok=True)
        self._log = (self._home / LOG_FILE).open("ab")
        self._process = subprocess.Popen(
            guarded_command(command),
            env={**os.environ, **_SERVER_ENV},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # out of the terminal's foreground process group: Ctrl-C is for d9d
        )
        api_url = f"http://127.0.0.1:{port}/api"
        try:
            wait_until_healthy(api_url, timeout_seconds=self._timeout)
        except BaseException:
            self.stop()
            raise
        self.api_url = api_url
        return api_url

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class _Current:
    server: EmbeddedApi | None = None


def embedded_api_url(home: Path, *, startup_timeout: float) -> str:
    """The URL of this process's embedded API, started on first use (and stopped when the process exits)."""
    server = _Current.server
    if server is None or server.pid is None:
        server = EmbeddedApi(home, startup_timeout=startup_timeout)
        server.start()
        _Current.server = server
        atexit.register(server.stop)
    return server.api_url


@contextlib.contextmanager
def using_api(api_url: str) -> Iterator[None]:
    """Prefect's client settings pointing at `api_url` for the duration (Prefect reads its settings at import)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_SERVER_EPHEMERAL_ENABLED: False}):
        yield


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Whether process `pid` is gone within `timeout` seconds (for tests and diagnostics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
