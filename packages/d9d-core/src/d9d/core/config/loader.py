"""Load a pydantic config from YAML, JSON or TOML, apply `a.b=c` overrides, validate, dump.

Overrides are parsed as YAML scalars/flow values (`lr=3e-4`, `units=[a, b]`, `name=null`), so they have the same
types as the file. `load_config` checks each override's key against the model's fields before validating
(`d9d.core.config.overrides`) and reports every problem as `ConfigError`, one line each, naming key and value.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from d9d.core.config.finite import require_finite
from d9d.core.config.overrides import ConfigError, apply_override, format_validation_error, merge_config

TConfig = TypeVar("TConfig", bound=BaseModel)


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw mapping stored in a YAML, JSON or TOML file (chosen by suffix; YAML for any other name).

    Raises `ConfigError` naming the file when it is missing, unreadable, not parseable, or not a mapping."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} is unreadable: {error}") from error
    try:
        match suffix:
            case ".json":
                data = json.loads(text)
            case ".toml":
                data = tomllib.loads(text)
            case _:
                data = yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        kind = {".json": "JSON", ".toml": "TOML"}.get(suffix, "YAML")
        raise ConfigError(f"config file {path} is not valid {kind}: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got a {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into its key path and its YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r}: expected the form key.path=value")
    path = [part.strip() for part in key.split(".")]
    if any(not part for part in path):
        raise ValueError(f"override {text!r}: empty segment in key path {key!r}")
    return path, yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with every `key.path=value` override set (intermediate mappings are created)."""
    result: dict[str, Any] = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                walked = ".".join(path[: depth + 1])
                raise ValueError(f"override {text!r}: {walked} is a {type(child).__name__}, not a mapping")
            node = child
        node[path[-1]] = value
    return result


def load_config(
    config_type: type[TConfig],
    path: Path | str | None = None,
    overrides: Sequence[str] = (),
    *,
    defaults: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> TConfig:
    """`config_type` from `defaults` (e.g. a preset), the file at `path` merged over them section by section, then
    each `key.path=value` override in order; validated once. Raises `ConfigError` naming every bad key and value
    (`source` says where the values came from in the message); `NonFiniteConfigError` (a `ConfigError`) when a
    float field is inf or nan."""
    data = _deep_copy(defaults or {})
    if path is not None:
        data = merge_config(data, read_config_file(Path(path)))
    for assignment in overrides:
        data = apply_override(data, assignment, config_type)
    try:
        config = config_type.model_validate(data)
    except ValidationError as error:
        where = source or " and ".join(
            part for part in (str(path) if path else "", "--set" if overrides else "") if part
        )
        raise ConfigError(format_validation_error(error, config_type, source=where or "defaults")) from error
    require_finite(config)
    return config


def dump_config(config: BaseModel, path: Path | str) -> Path:
    """Write `config` (JSON-compatible values) as YAML or JSON, by suffix; returns the path (TOML is read only)."""
    target = Path(path)
    data = config.model_dump(mode="json")
    match target.suffix.lower():
        case ".yaml" | ".yml":
            text = yaml.safe_dump(data, sort_keys=False)
        case ".json":
            text = json.dumps(data, indent=2) + "\n"
        case other:
            raise ValueError(f"cannot dump to {target}: unknown suffix {other!r}; valid: .yaml, .yml, .json")
    target.write_text(text, encoding="utf-8")
    return target


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _deep_copy(value) if isinstance(value, Mapping) else value for key, value in data.items()}
