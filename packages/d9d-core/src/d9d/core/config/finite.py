"""Refuse non-finite numbers anywhere in a validated config (`lr=.inf`, `weight_decay=nan`).

Pydantic's floats accept `inf` and `nan` (YAML `.inf`, the strings "inf"/"nan"), and a training run with such a
value trains to NaN instead of failing. No d9d setting means "infinite" by a float (None is how a config says
"no limit"), so every loaded config is walked once after validation, in one place, rather than asking each of the
packages' models to opt in with `allow_inf_nan=False`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from d9d.core.config.overrides import ConfigError


class NonFiniteConfigError(ConfigError):
    """A config value is inf or nan; the message names each field as `--set` spells it."""


def non_finite_fields(config: BaseModel) -> list[tuple[str, float]]:
    """(dotted field path, value) of every float in `config` (nested models, lists, dicts) that is inf or nan."""
    return list(_walk(config, ""))


def require_finite(config: BaseModel) -> None:
    """Raise `NonFiniteConfigError` naming every non-finite field of `config`.

    Raises:
        NonFiniteConfigError: at least one float field is inf or nan.
    """
    bad = non_finite_fields(config)
    if bad:
        fields = "; ".join(f"{path}={value}" for path, value in bad)
        raise NonFiniteConfigError(f"non-finite config values are not allowed: {fields}; give a finite number")


def _walk(value: Any, path: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, float):
        if not math.isfinite(value):
            yield path or "(top level)", value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for position, item in enumerate(value):
            yield from _walk(item, f"{path}.{position}" if path else str(position))
