"""Secrets never reach what a run writes: a wandb key and a database password planted in the environment of a whole
micro pipeline run, and a database password given to `d9d server start` on its failure path (Postgres down), appear
in no file, log, database or console output. Isolated: real `d9d` processes with their own Prefect API."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.isolated


def _clean_env(home: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    return {**env, "D9D_HOME": str(home)}


def _files_holding(root: Path, secret: str) -> list[str]:
    """Every file under `root` whose bytes contain `secret` (binary files too: SQLite databases, checkpoints)."""
    needle = secret.encode()
    return [str(path) for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


def test_a_pipeline_run_writes_no_planted_secret_anywhere(tmp_path):
    wandb_key = f"wandb-{uuid.uuid4().hex}"
    password = f"pw-{uuid.uuid4().hex}"
    env = {
        **_clean_env(tmp_path / "home"),
        "WANDB_API_KEY": wandb_key,
        "PGPASSWORD": password,
        "DATABASE_URL": f"postgresql://d9d:{password}@db.internal:5432/d9d",
    }
    argv = ["run", "pipeline", "--preset", "micro", "--set", f"workdir={tmp_path / 'run'}"]
    done = subprocess.run(
        [sys.executable, "-m", "d9d.flows.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    written = sorted(str(path) for path in tmp_path.rglob("*") if path.is_file())
    assert any(path.endswith("prefect.db") for path in written)  # the flow runs' records are searched too
    assert any(path.endswith("launch.log") for path in written)
    for secret in (wandb_key, password):
        assert secret not in output
        assert _files_holding(tmp_path, secret) == []


def test_a_database_password_never_reaches_the_servers_output_when_its_database_is_down(tmp_path):
    password = f"pw-{uuid.uuid4().hex}"
    url = f"postgresql+asyncpg://prefect:{password}@127.0.0.1:1/prefect"  # nothing listens on port 1
    command = [sys.executable, "-m", "d9d.flows.cli", "server", "start", "--port", "4399", "--no-ui"]
    done = subprocess.run(
        [*command, "--database-url", url],
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Application startup failed" in output, output
    assert "postgresql+asyncpg://prefect:***@127.0.0.1:1/prefect" in output  # what it said it would connect to
    assert password not in output
    assert _files_holding(tmp_path, password) == []
