"""Non-finite numbers (`.inf`, `nan`, "inf") are refused by the config loader with the field named."""

import pytest
from pydantic import BaseModel, ConfigDict

from d9d.core.config import NonFiniteConfigError, load_config, non_finite_fields
from d9d.core.loop import TrainerConfig


class Optimizer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


class Job(BaseModel):
    model_config = ConfigDict(extra="forbid")
    optimizer: Optimizer = Optimizer()
    scales: dict[str, float] = {}


@pytest.mark.parametrize("raw", [".inf", "-.inf", ".nan", "inf", "nan", "1e999"])
def test_a_non_finite_override_fails_naming_the_field(raw):
    with pytest.raises(NonFiniteConfigError, match=r"optimizer\.lr="):
        load_config(Job, overrides=[f"optimizer.lr={raw}"])


def test_non_finite_values_inside_tuples_and_mappings_are_named(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optimizer:\n  betas: [0.9, .nan]\nscales:\n  head: .inf\n")
    with pytest.raises(NonFiniteConfigError, match=r"optimizer\.betas\.1=nan; scales\.head=inf"):
        load_config(Job, path)


def test_finite_values_load_and_the_walk_finds_nothing():
    config = load_config(Job, overrides=["optimizer.lr=3e-4", "scales.head=2.5"])
    assert config.optimizer.lr == 3e-4
    assert non_finite_fields(config) == []


def test_trainer_config_refuses_an_infinite_grad_norm_limit():
    with pytest.raises(NonFiniteConfigError, match=r"max_grad_norm=inf"):
        load_config(
            TrainerConfig, overrides=["total_steps=1", "global_batch_rows=1", "microbatch_rows=1", "max_grad_norm=.inf"]
        )
