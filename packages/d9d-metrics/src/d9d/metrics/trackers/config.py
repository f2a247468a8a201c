"""Tracker configuration: a discriminated union on `kind`, resolved by `build_tracker`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field

from d9d.metrics.trackers.base import BaseTracker, NullTracker


class NoTrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["none"] = "none"


class JsonlTrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["jsonl"] = "jsonl"
    directory: Path = Field(description="`<run_id>.jsonl` and `<run_id>.hparams.json` go here")


class TensorBoardTrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["tensorboard"] = "tensorboard"
    directory: Path = Field(description="event files go into `<directory>/<run_id>/`")


class AimTrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["aim"] = "aim"
    repo: Path = Field(description="a local aim repository (created if missing)")
    experiment: str = Field(default="d9d", description="the run family: training and evaluation runs share it")


class WandbTrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["wandb"] = "wandb"
    mode: Literal["offline", "online", "disabled"] = "offline"
    directory: Path = Field(description="wandb's `dir`: offline runs are written under `<directory>/wandb/`")
    project: str = "d9d"
    group: str | None = Field(default=None, description="the run family: training and evaluation runs share it")
    entity: str | None = None
    flush_interval_s: float = Field(default=0.1, gt=0, description="how often wandb writes the `.wandb` file")


AnyTrackerConfig = Annotated[
    NoTrackerConfig | JsonlTrackerConfig | TensorBoardTrackerConfig | AimTrackerConfig | WandbTrackerConfig,
    Field(discriminator="kind"),
]


def build_tracker(
    config: AnyTrackerConfig,
    *,
    enabled: bool,
    hparams: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> BaseTracker:
    """The tracker of `config`. Pass `enabled=ctx.is_main_process`: only the main process writes. `hparams` (nested
    is fine) are logged flattened; `name` labels the run where the backend has names (aim, wandb)."""
    match config:
        case NoTrackerConfig():
            return NullTracker()
        case JsonlTrackerConfig():
            from d9d.metrics.trackers.jsonl import JsonlTracker

            return JsonlTracker(config.directory, enabled=enabled, hparams=hparams)
        case TensorBoardTrackerConfig():
            from d9d.metrics.trackers.tensorboard_tracker import TensorBoardTracker

            return TensorBoardTracker(config.directory, enabled=enabled, hparams=hparams)
        case AimTrackerConfig():
            from d9d.metrics.trackers.aim_tracker import AimTracker

            return AimTracker(config.repo, experiment=config.experiment, name=name, enabled=enabled, hparams=hparams)
        case WandbTrackerConfig():
            from d9d.metrics.trackers.wandb_tracker import WandbTracker

            return WandbTracker(
                config.directory,
                project=config.project,
                group=config.group,
                name=name,
                entity=config.entity,
                mode=config.mode,
                flush_interval_s=config.flush_interval_s,
                enabled=enabled,
                hparams=hparams,
            )
        case _:
            assert_never(config)
