"""Model-aware configuration: `--set key.path=value` checked against a pydantic model's fields (through
discriminated unions by `kind`), files merged over defaults section by section, and validation errors as one line
per problem with the key spelled as `--set` spells it. `load_config` uses them; so does any program that builds its
config from several sources (d9d-flows' job config: a preset, a file, `--set`)."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """The configuration is invalid; the message names each bad key, its value and what would be valid."""


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            # A section whose `kind` changes starts from the new kind, not a mix of two variants.
            if value.get("kind", merged[key].get("kind")) != merged[key].get("kind"):
                merged[key] = dict(value)
            else:
                merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_override(data: dict[str, Any], assignment: str, model: type[BaseModel]) -> dict[str, Any]:
    """Apply one `key.path=value` (value parsed as YAML) to `data`, checking the key against `model`'s fields.

    The key must name a field at every level (through discriminated unions, the member the section's `kind`
    names); setting `kind` to another value starts the section afresh from that kind's defaults."""
    key, separator, raw_value = assignment.partition("=")
    if not separator or not key:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. data_prep.workers=2), got {assignment!r}")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {key}: the value {raw_value!r} is not valid YAML: {error}") from error
    parts = key.split(".")
    result = dict(data)
    node = result
    choices: list[type[BaseModel]] = [model]
    for depth, part in enumerate(parts):
        current = _choose(choices, node, part)
        fields = current.model_fields
        if part not in fields:
            where = ".".join(parts[:depth]) or "the job config"
            raise ConfigError(
                f"unknown --set key {key!r}: {where} has no field {part!r}; valid fields: {', '.join(fields)}"
                f"{_other_kind_hint(choices, current, part, where)}"
            )
        if depth == len(parts) - 1:
            if part == "kind" and node.get("kind") not in (None, value):
                # Switching a section's kind starts it afresh from that kind's defaults.
                node.clear()
            node[part] = value
            return result
        choices = models_in(fields[part].annotation)
        if not choices and _is_mapping(fields[part].annotation):
            # A free-form mapping (`dict[str, float]`): its keys are data, not fields; pydantic checks the values.
            _set_path(node, parts[depth:], value)
            return result
        if not choices:
            raise ConfigError(
                f"unknown --set key {key!r}: {'.'.join(parts[: depth + 1])} is a value, not a section with fields"
            )
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    return result


def _is_mapping(annotation: Any) -> bool:
    return any(typing.get_origin(arg) in (dict, Mapping) or arg is dict for arg in _flatten(annotation))


def _set_path(node: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for part in path[:-1]:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[path[-1]] = value


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes a field holds: one, or the members of a discriminated union."""
    return [arg for arg in _flatten(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]


def _kind_of(model: type[BaseModel]) -> Any:
    field = model.model_fields.get("kind")
    return None if field is None else field.default


def _choose(choices: list[type[BaseModel]], node: dict[str, Any], next_part: str) -> type[BaseModel]:
    """The member of `choices` the section's data is validated as: the one its `kind` names, else a likely one."""
    if len(choices) == 1:
        return choices[0]
    kind = node.get("kind")
    for candidate in choices:
        if kind is not None and _kind_of(candidate) == kind:
            return candidate
    if kind is None:
        for candidate in choices:
            if next_part in candidate.model_fields:
                return candidate
    return choices[0]


def _flatten(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [leaf for arg in typing.get_args(annotation) for leaf in _flatten(arg)]
    return [annotation]


def _other_kind_hint(choices: list[type[BaseModel]], current: type[BaseModel], part: str, where: str) -> str:
    for other in choices:
        if other is not current and part in other.model_fields:
            return f" ({part!r} belongs to kind={_kind_of(other)!r}: set {where}.kind={_kind_of(other)} first)"
    return ""


def format_validation_error(error: ValidationError, model: type[BaseModel], *, source: str) -> str:
    """One line per problem: the dotted key (as `--set` spells it), the value given, and what would be valid."""
    lines = [f"invalid config (from {source}):"]
    for problem in error.errors(include_url=False):
        if problem["type"] == "extra_forbidden":
            parent_location, parent = _walk(model, problem["loc"][:-1])
            location = ".".join([*parent_location, str(problem["loc"][-1])])
            valid = f"; valid fields: {', '.join(parent.model_fields)}" if parent is not None else ""
            lines.append(f"  {location}: unknown field{valid}")
            continue
        location = ".".join(_walk(model, problem["loc"])[0]) or "(top level)"
        given = problem.get("input")
        # A whole section as "the value" is noise; the message of a section-level check names its fields.
        shown = "" if problem["type"] == "missing" or isinstance(given, dict) else f" = {given!r}"
        lines.append(f"  {location}{shown}: {problem['msg']}")
    return "\n".join(lines)


def _walk(model: type[BaseModel], location: Sequence[int | str]) -> tuple[list[str], type[BaseModel] | None]:
    """The location as a user writes it (union tags dropped) and the model class found there, if any."""
    shown: list[str] = []
    choices: list[type[BaseModel]] = [model]
    for part in location:
        if isinstance(part, int):
            shown.append(str(part))
            continue
        if len(choices) > 1:
            # Pydantic puts a discriminated-union member's tag into the location (e.g. "file"); users never type it.
            tagged = [choice for choice in choices if _kind_of(choice) == part]
            if len(tagged) == 1:
                choices = tagged
                continue
        shown.append(part)
        if len(choices) == 1 and part in choices[0].model_fields:
            choices = models_in(choices[0].model_fields[part].annotation)
        else:
            choices = []
    return shown, choices[0] if len(choices) == 1 else None
