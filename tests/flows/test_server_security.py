"""`d9d server start` never listens beyond this machine without a login: a non-loopback host is refused unless
Prefect's basic-auth string or `--behind-auth-proxy` is set; with the auth string, a real server answers API calls
only with the login (its health probe stays open for orchestrators). Isolated: it starts a real server."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from d9d.flows.deployments.server import SERVER_AUTH_ENV, is_loopback, plan_server, wait_until_healthy

pytestmark = pytest.mark.isolated


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts_need_no_login(host, tmp_path):
    assert is_loopback(host)
    plan_server(host=host, port=4200, database_url=None, ui=False, environ={"D9D_HOME": str(tmp_path)})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "server.internal"])
def test_other_hosts_are_refused_without_a_login_and_accepted_with_one(host, tmp_path):
    environ = {"D9D_HOME": str(tmp_path)}
    with pytest.raises(ValueError, match=rf"--host {host} would let anyone .*{SERVER_AUTH_ENV}=USER:PASSWORD"):
        plan_server(host=host, port=4200, database_url=None, ui=False, environ=environ)
    plan_server(host=host, port=4200, database_url=None, ui=False, environ={**environ, SERVER_AUTH_ENV: "a:b"})
    plan_server(host=host, port=4200, database_url=None, ui=False, environ=environ, behind_auth_proxy=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _clean_env(tmp_path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    return {**env, "D9D_HOME": str(tmp_path / "home")}


def test_the_command_refuses_an_open_host_before_starting_anything(tmp_path):
    port = _free_port()
    command = [sys.executable, "-m", "d9d.flows.cli", "server", "start", "--host", "0.0.0.0", "--port", str(port)]
    done = subprocess.run(command, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "d9d: error: --host 0.0.0.0 would let anyone who reaches it run flows" in done.stderr
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens


def _post(url: str, login: str | None) -> int:
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    if login is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_an_open_host_with_the_auth_string_answers_only_with_the_login(tmp_path):
    port, login = _free_port(), "team:correct-horse-battery"
    env = {**_clean_env(tmp_path), SERVER_AUTH_ENV: login}
    command = [sys.executable, "-m", "d9d.flows.cli", "server", "start", "--host", "0.0.0.0", "--port", str(port)]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        wait_until_healthy(api, timeout_seconds=180)  # the health probe needs no login
        assert _post(f"{api}/flows/filter", None) == 401
        assert _post(f"{api}/flows/filter", "team:wrong") == 401
        assert _post(f"{api}/flows/filter", login) == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
    printed = (tmp_path / "server.log").read_text()
    assert "export PREFECT_API_AUTH_STRING=<the value of PREFECT_SERVER_API_AUTH_STRING>" in printed
    assert "correct-horse-battery" not in printed
