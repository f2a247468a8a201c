"""Generic configuration loading: pydantic models from YAML, JSON or TOML with `key.path=value` overrides."""

from d9d.core.config.finite import NonFiniteConfigError, non_finite_fields, require_finite
from d9d.core.config.loader import apply_overrides, dump_config, load_config, parse_override, read_config_file

__all__ = [
    "NonFiniteConfigError",
    "apply_overrides",
    "dump_config",
    "load_config",
    "non_finite_fields",
    "parse_override",
    "read_config_file",
    "require_finite",
]
