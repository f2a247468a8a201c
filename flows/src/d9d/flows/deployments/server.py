"""`d9d server start`: a Prefect server for schedules, workers and a UI; SQLite in the d9d home unless told otherwise.

The server runs as `prefect server start` in place of this process (exec), so signals reach it directly. Its home
is `$D9D_HOME/server`, apart from the embedded API's `$D9D_HOME/prefect`: two writers on one SQLite file lock each
other out. For a team, point `--database-url` at Postgres (`postgresql+asyncpg://USER:PASSWORD@HOST:5432/prefect`).

Prefect's open-source server has no users. On a loopback address only this machine reaches it; any other address
is refused unless a login protects it: `PREFECT_SERVER_API_AUTH_STRING` (`user:password`, HTTP basic auth; clients
set the same value as `PREFECT_API_AUTH_STRING`) or `--behind-auth-proxy` (the operator's statement that a reverse
proxy in front of it authenticates every request). Passwords are never printed.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from d9d.flows.runtime import QUIET_SETTINGS, d9d_home

DATABASE_URL_ENV = "PREFECT_API_DATABASE_CONNECTION_URL"
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # the server's basic-auth `user:password`
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # the same value, on every client


@dataclass(frozen=True, kw_only=True)
class ServerPlan:
    argv: list[str]
    environ: dict[str, str]
    api_url: str
    database: str


def plan_server(
    *,
    host: str,
    port: int,
    database_url: str | None,
    ui: bool,
    environ: Mapping[str, str],
    behind_auth_proxy: bool = False,
) -> ServerPlan:
    """The command and environment that start the server; settings the user already set are kept."""
    if not 0 < port < 65536:
        raise ValueError(f"--port {port} is not a TCP port; use 1-65535 (Prefect's default is 4200)")
    refuse_open_server(host, environ, behind_auth_proxy=behind_auth_proxy)
    env = dict(environ)
    for name, value in QUIET_SETTINGS.items():
        env.setdefault(name, value)
    env.pop("PREFECT_API_URL", None)  # the server serves the API; it must not try to reach another one
    home = Path(env.setdefault("PREFECT_HOME", str(d9d_home(env) / "server"))).expanduser()
    home.mkdir(parents=True, exist_ok=True)  # Prefect does not create a home's parents
    env.setdefault("PREFECT_UI_ENABLED", "true" if ui else "false")
    if database_url is not None:
        if not database_url.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            raise ValueError(
                f"--database-url {_redacted(database_url)!r} is not a database Prefect can use; valid: "
                "postgresql+asyncpg://USER:PASSWORD@HOST:5432/DB or sqlite+aiosqlite:///PATH"
            )
        env[DATABASE_URL_ENV] = database_url
    database = env.get(DATABASE_URL_ENV) or f"SQLite at {home / 'prefect.db'}"
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # noqa: S104 - a comparison, not a bind
    return ServerPlan(argv=argv, environ=env, api_url=f"http://{shown_host}:{port}/api", database=_redacted(database))


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (`localhost` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def refuse_open_server(host: str, environ: Mapping[str, str], *, behind_auth_proxy: bool) -> None:
    """`ValueError` when the server would listen beyond this machine with no login in front of it."""
    if is_loopback(host) or behind_auth_proxy or environ.get(SERVER_AUTH_ENV):
        return
    raise ValueError(
        f"--host {host} would let anyone who reaches it run flows and read every run (Prefect's server has no "
        f"users): set {SERVER_AUTH_ENV}=USER:PASSWORD (clients then set {CLIENT_AUTH_ENV} to the same value), "
        "or put it behind a reverse proxy that authenticates every request and pass --behind-auth-proxy, "
        "or listen on 127.0.0.1 (the default)"
    )


def start_server(plan: ServerPlan) -> None:
    """Replace this process with the Prefect server (returns only if exec fails)."""
    say = sys.stderr.write
    say(f"d9d: starting a Prefect server for {plan.api_url} ({plan.database})\n")
    say(f"d9d: in other shells and on workers: export PREFECT_API_URL={plan.api_url}\n")
    if plan.environ.get(SERVER_AUTH_ENV):
        say(f"d9d: clients log in: export {CLIENT_AUTH_ENV}=<the value of {SERVER_AUTH_ENV}>\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os.execve(plan.argv[0], plan.argv, plan.environ)  # noqa: S606 - argv is fixed here, no shell involved


def wait_until_healthy(api_url: str, *, timeout_seconds: float) -> float:
    """Seconds until `GET {api_url}/health` answered 200; TimeoutError naming the URL if it never did."""
    if not api_url.startswith(("http://", "https://")):
        raise ValueError(f"api_url={api_url!r} is not an http(s) URL")
    started = time.monotonic()
    last_error = "no answer"
    while time.monotonic() - started < timeout_seconds:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:  # noqa: S310 - http(s), checked
                if response.status == 200:
                    return time.monotonic() - started
                last_error = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as error:
            last_error = str(error)
        time.sleep(0.25)
    raise TimeoutError(f"the Prefect API at {api_url} was not healthy after {timeout_seconds:.0f} s ({last_error})")


def _redacted(database: str) -> str:
    """A connection URL without its password, for printing."""
    scheme, separator, rest = database.partition("://")
    if not separator or "@" not in rest:
        return database
    credentials, _, location = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{location}"
