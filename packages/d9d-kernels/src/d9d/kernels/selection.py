"""The one backend-selection rule shared by every kernel family.

Precedence: an explicit config, else the JSON in the environment variable `D9D_BACKEND_AUTO_<FAMILY>` (e.g.
`D9D_BACKEND_AUTO_ATTENTION='{"kind": "eager"}'`), else the family's capability detection. Each family supplies
its discriminated union of configs and its detection function; this module supplies the order and the errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from d9d.kernels.capability import Capabilities, detect_capabilities

ENV_PREFIX = "D9D_BACKEND_AUTO_"

ConfigT = TypeVar("ConfigT")


def env_variable(family: str) -> str:
    """The environment variable that overrides auto-selection for `family` (e.g. 'grouped_mm')."""
    return ENV_PREFIX + family.upper()


def resolve_backend_config(
    family: str,
    explicit: ConfigT | None,
    adapter: TypeAdapter[ConfigT],
    detect: Callable[[Capabilities], ConfigT],
    *,
    capabilities: Capabilities | None = None,
    environ: Mapping[str, str] | None = None,
) -> ConfigT:
    """The config to build: `explicit`, else the environment's, else `detect(capabilities)`.

    Raises:
        ValueError: the environment variable holds JSON that is not a valid config of the family; the message names
            the variable and the valid kinds.
    """
    if explicit is not None:
        return explicit
    environ = os.environ if environ is None else environ
    name = env_variable(family)
    raw = environ.get(name)
    if raw is not None and raw.strip():
        try:
            parsed = adapter.validate_json(raw)
        except ValidationError as error:
            kinds = valid_kinds(adapter)
            example = f'{name}=\'{{"kind": "{kinds[0]}"}}\'' if kinds else name
            raise ValueError(
                f"{name}={raw!r} is not a valid {family} backend config: {error.errors()[0]['msg']}. "
                f"Valid kinds: {', '.join(kinds)}; e.g. {example}"
            ) from error
        return parsed
    return detect(capabilities if capabilities is not None else detect_capabilities())


def valid_kinds(adapter: TypeAdapter[Any]) -> list[str]:
    """The `kind` values of a discriminated union of configs, read from its JSON schema."""
    schema = adapter.json_schema()
    mapping = schema.get("discriminator", {}).get("mapping", {})
    return sorted(mapping)


def triton_detected(capabilities: Capabilities) -> bool:
    """Whether detection picks a family's Triton backend: a Hopper-class GPU (sm90+, what the autotuned configs are
    for) with `triton` installed; never on CPU, where Triton only runs in its slow interpreter."""
    return capabilities.cuda_at_least(9, 0) and capabilities.has_package("triton")
