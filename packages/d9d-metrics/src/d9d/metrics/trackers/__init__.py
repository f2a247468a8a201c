"""Experiment trackers behind one interface (d9d-core's `Tracker` protocol plus `close`), selected by config.

aim, wandb and TensorBoard are optional extras, imported only when their tracker is used.
"""

from d9d.metrics.trackers.aim_tracker import AimTracker
from d9d.metrics.trackers.base import BaseTracker, NullTracker, flatten_hparams
from d9d.metrics.trackers.config import (
    AimTrackerConfig,
    AnyTrackerConfig,
    JsonlTrackerConfig,
    NoTrackerConfig,
    TensorBoardTrackerConfig,
    WandbTrackerConfig,
    build_tracker,
)
from d9d.metrics.trackers.group import TrackerGroup
from d9d.metrics.trackers.jsonl import JsonlTracker
from d9d.metrics.trackers.tensorboard_tracker import TensorBoardTracker
from d9d.metrics.trackers.wandb_tracker import WandbTracker

__all__ = [
    "AimTracker",
    "AimTrackerConfig",
    "AnyTrackerConfig",
    "BaseTracker",
    "JsonlTracker",
    "JsonlTrackerConfig",
    "NoTrackerConfig",
    "NullTracker",
    "TensorBoardTracker",
    "TensorBoardTrackerConfig",
    "TrackerGroup",
    "WandbTracker",
    "WandbTrackerConfig",
    "build_tracker",
    "flatten_hparams",
]
