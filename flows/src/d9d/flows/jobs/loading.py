"""Build a `JobConfig` from a preset, a YAML file and `--set key=value` overrides, through d9d-core's config loader
(the one set of override rules: keys checked against the fields, `kind` switches a section, errors name key and
value), then make its paths absolute and check that the working directory can be one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from d9d.core.config import ConfigError, load_config
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.presets import preset


class JobConfigError(ConfigError):
    """The job configuration is invalid; the message names each bad key, its value and what would be valid."""


def load_job_config(
    *,
    preset_name: str | None = None,
    config_file: Path | None = None,
    overrides: Sequence[str] = (),
    base: Path | None = None,
) -> JobConfig:
    """Preset, then the file over it, then each `--set` in order; relative paths resolve against `base` (cwd)."""
    defaults: dict[str, Any] = {}
    if preset_name is not None:
        try:
            defaults = preset(preset_name)
        except KeyError as error:
            raise JobConfigError(str(error.args[0])) from error
    source = " and ".join(
        part
        for part in (
            f"preset {preset_name!r}" if preset_name else "",
            str(config_file) if config_file else "",
            "--set" if overrides else "",
        )
        if part
    )
    try:
        config = load_config(JobConfig, config_file, overrides, defaults=defaults, source=source or "defaults")
    except ConfigError as error:
        raise JobConfigError(str(error)) from error
    resolved = config.resolved(base if base is not None else Path.cwd())
    check_workdir(resolved.workdir)
    return resolved


def check_workdir(workdir: Path) -> None:
    """The working directory is a directory, or can become one (no file in the way)."""
    for path in (workdir, *workdir.parents):
        if path.exists():
            if not path.is_dir():
                where = "is a file" if path == workdir else f"is under {path}, which is a file"
                raise JobConfigError(
                    f"workdir={workdir} {where}; point workdir at a directory (it is created if missing)"
                )
            return
