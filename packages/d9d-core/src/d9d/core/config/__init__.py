"""Generic configuration loading: pydantic models from YAML, JSON or TOML with `key.path=value` overrides."""

from d9d.core.config.loader import apply_overrides, dump_config, load_config, parse_override, read_config_file

__all__ = ["apply_overrides", "dump_config", "load_config", "parse_override", "read_config_file"]
