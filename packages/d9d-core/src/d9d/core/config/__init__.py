"""Generic configuration loading: pydantic models from YAML, JSON or TOML with `key.path=value` overrides checked
against the model's fields, errors naming each bad key and value."""

from d9d.core.config.finite import NonFiniteConfigError, non_finite_fields, require_finite
from d9d.core.config.loader import apply_overrides, dump_config, load_config, parse_override, read_config_file
from d9d.core.config.overrides import ConfigError, apply_override, format_validation_error, merge_config

__all__ = [
    "ConfigError",
    "NonFiniteConfigError",
    "apply_override",
    "apply_overrides",
    "dump_config",
    "format_validation_error",
    "load_config",
    "merge_config",
    "non_finite_fields",
    "parse_override",
    "read_config_file",
    "require_finite",
]
