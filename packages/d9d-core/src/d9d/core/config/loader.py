"""Load a pydantic config from YAML, JSON or TOML, apply `a.b=c` overrides, validate, dump.

Overrides are parsed as YAML scalars/flow values (`lr=3e-4`, `units=[a, b]`, `name=null`), so they have the same
types as the file. Unknown keys are rejected by the models themselves (`extra="forbid"`); a `--set` path through
a key that is not a mapping fails here with the path named.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from d9d.core.config.finite import require_finite

TConfig = TypeVar("TConfig", bound=BaseModel)

SUFFIXES = (".yaml", ".yml", ".json", ".toml")


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw mapping stored in a YAML, JSON or TOML file (chosen by suffix)."""
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"config file {path}: unknown suffix {path.suffix!r}; valid: {', '.join(SUFFIXES)}")
    text = path.read_text(encoding="utf-8")
    match path.suffix.lower():
        case ".yaml" | ".yml":
            data = yaml.safe_load(text)
        case ".json":
            data = json.loads(text)
        case ".toml":
            data = tomllib.loads(text)
        case other:
            raise ValueError(f"config file {path}: unknown suffix {other!r}; valid: {', '.join(SUFFIXES)}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: the top level must be a mapping, got {type(data).__name__}")
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


def load_config(config_type: type[TConfig], path: Path | str | None = None, overrides: Sequence[str] = ()) -> TConfig:
    """Validate `config_type` from an optional file plus overrides (pydantic's errors name the bad fields).

    Raises:
        NonFiniteConfigError: a float field is inf or nan (named as its dotted key path).
    """
    data = read_config_file(Path(path)) if path is not None else {}
    config = config_type.model_validate(apply_overrides(data, overrides))
    require_finite(config)
    return config


def dump_config(config: BaseModel, path: Path | str) -> Path:
    """Write `config` (JSON-compatible values) in the format the suffix names; returns the path."""
    target = Path(path)
    data = config.model_dump(mode="json")
    match target.suffix.lower():
        case ".yaml" | ".yml":
            text = yaml.safe_dump(data, sort_keys=False)
        case ".json":
            text = json.dumps(data, indent=2) + "\n"
        case ".toml":
            text = _to_toml(data)
        case other:
            raise ValueError(f"cannot dump to {target}: unknown suffix {other!r}; valid: {', '.join(SUFFIXES)}")
    target.write_text(text, encoding="utf-8")
    return target


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _deep_copy(value) if isinstance(value, Mapping) else value for key, value in data.items()}


def _to_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """A minimal TOML writer for pydantic dumps: scalars, lists of scalars, nested tables (no `None`)."""
    scalars = [
        f"{key} = {_toml_value(value, prefix + key)}"
        for key, value in data.items()
        if not isinstance(value, Mapping) and value is not None
    ]
    tables = [
        f"\n[{prefix}{key}]\n" + _to_toml(value, f"{prefix}{key}.")
        for key, value in data.items()
        if isinstance(value, Mapping)
    ]
    return "\n".join(scalars) + ("\n" if scalars else "") + "".join(tables)


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item, where) for item in value) + "]"
    raise ValueError(f"cannot write {where}={value!r} as TOML (only scalars, lists and tables)")
