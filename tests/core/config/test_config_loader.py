"""The generic config loader: three formats, dotted overrides with typed values, unknown keys rejected, dumps."""

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from d9d.core.config import ConfigError, apply_overrides, dump_config, load_config, parse_override
from d9d.core.loop import TrainerConfig


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = 1e-3
    names: list[str] = []


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int
    inner: Inner = Inner()


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".yaml", "steps: 3\ninner:\n  lr: 0.5\n"),
        (".json", '{"steps": 3, "inner": {"lr": 0.5}}'),
        (".toml", "steps = 3\n[inner]\nlr = 0.5\n"),
    ],
)
def test_each_format_loads_the_same_config(tmp_path, suffix, text):
    path = tmp_path / f"config{suffix}"
    path.write_text(text)
    assert load_config(Outer, path) == Outer(steps=3, inner=Inner(lr=0.5))


def test_overrides_are_typed_like_yaml_and_create_nested_mappings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\n")
    config = load_config(Outer, path, ["inner.lr=3e-4", "inner.names=[a, b]", "steps=7"])
    assert config == Outer(steps=7, inner=Inner(lr=3e-4, names=["a", "b"]))
    assert parse_override("a.b.c=null") == (["a", "b", "c"], None)


def test_unknown_keys_are_rejected_naming_the_field_and_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"unknown --set key 'inner\.lrr': inner has no field 'lrr'; valid fields: lr"
    ):
        load_config(Outer, None, ["steps=1", "inner.lrr=1"])


def test_a_file_is_merged_over_defaults_and_a_bad_value_names_key_value_and_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  names: [x]\n")
    config = load_config(Outer, path, defaults={"steps": 2, "inner": {"lr": 0.5}})
    assert config == Outer(steps=2, inner=Inner(lr=0.5, names=["x"]))
    with pytest.raises(ConfigError, match=r"invalid config \(from c\.yaml and --set\):\n  steps = 'many'"):
        load_config(Outer, path, ["steps=many"], source="c.yaml and --set")


def test_override_through_a_scalar_and_malformed_overrides_fail_clearly():
    with pytest.raises(ValueError, match="steps is a int, not a mapping"):
        apply_overrides({"steps": 1}, ["steps.x=2"])
    with pytest.raises(ValueError, match=r"expected the form key\.path=value"):
        parse_override("steps")
    with pytest.raises(ConfigError, match=r"config file x\.ini does not exist"):
        load_config(Outer, Path("x.ini"))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_dump_then_load_round_trips(tmp_path, suffix):
    config = Outer(steps=5, inner=Inner(lr=0.25, names=["x"]))
    assert load_config(Outer, dump_config(config, tmp_path / f"dump{suffix}")) == config


def test_trainer_config_checks_the_batch_against_the_data_parallel_size():
    config = load_config(TrainerConfig, None, ["total_steps=10", "global_batch_rows=12", "microbatch_rows=2"])
    assert config.microbatches_per_step(2) == 3
    assert config.microbatches_per_step(3) == 2
    with pytest.raises(ValueError, match="over 4 data-parallel ranks; make it a multiple of 8"):
        config.microbatches_per_step(4)
    with pytest.raises(ConfigError, match="not a multiple of microbatch_rows=5"):
        load_config(TrainerConfig, None, ["total_steps=1", "global_batch_rows=12", "microbatch_rows=5"])
