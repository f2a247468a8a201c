"""Where flows report to: a Prefect API the user configured, or else the embedded default.

The embedded default is a local Prefect API on SQLite that Prefect starts as a subprocess on first use and stops
at exit, kept quiet and offline. Prefect reads its settings when it is imported, so `configure_prefect` runs
before anything imports `prefect`; it only fills in settings the user has not set.
"""

from __future__ import annotations

import os
import sys
import tomllib
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

D9D_HOME_ENV = "D9D_HOME"

# Quiet and offline wherever the API is: no telemetry, only warnings on the console (d9d prints its own progress).
QUIET_SETTINGS = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
}


class _State:
    configured = False


@dataclass(frozen=True, kw_only=True)
class PrefectTarget:
    mode: Literal["embedded", "configured"]
    description: str


def d9d_home(environ: MutableMapping[str, str]) -> Path:
    return Path(environ.get(D9D_HOME_ENV) or "~/.d9d").expanduser()


def configure_prefect(environ: MutableMapping[str, str] | None = None) -> PrefectTarget:
    """Fill in Prefect's settings for this process: the user's API if one is configured, else the embedded one."""
    environ = os.environ if environ is None else environ
    if environ is os.environ:
        if "prefect" in sys.modules and not _State.configured:
            # Settings read at import time (logging) would not follow; say so rather than half-apply them.
            warnings.warn("prefect was imported before d9d configured it; its logging settings apply", stacklevel=2)
        _State.configured = True
    for name, value in QUIET_SETTINGS.items():
        environ.setdefault(name, value)
    configured = environ.get("PREFECT_API_URL") or _profile_api_url(environ)
    if configured:
        return PrefectTarget(mode="configured", description=f"the Prefect API at {configured}")
    home = Path(environ.setdefault("PREFECT_HOME", str(d9d_home(environ) / "prefect"))).expanduser()
    embedded = {
        "PREFECT_SERVER_EPHEMERAL_ENABLED": "true",
        # A fresh SQLite database: 15-20 s on a 2-core machine, over 2 min under heavy load; Prefect gives up at 20 s.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
    }
    for name, value in embedded.items():
        environ.setdefault(name, value)
    # Prefect creates its home without parents and then cannot open the database; create the whole path.
    home.mkdir(parents=True, exist_ok=True)
    return PrefectTarget(
        mode="embedded",
        description=f"the embedded local Prefect API on SQLite at {home / 'prefect.db'}",
    )


def _profile_api_url(environ: MutableMapping[str, str]) -> str | None:
    """The API URL of the user's active Prefect profile, if their profiles file sets one."""
    home = Path(environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    path = Path(environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    active = environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    settings = profiles.get("profiles", {}).get(active, {})
    url = settings.get("PREFECT_API_URL") if isinstance(settings, dict) else None
    return str(url) if url else None
