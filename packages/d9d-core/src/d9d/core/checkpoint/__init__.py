"""Job checkpoints: DCP folders with a completion marker, newest-complete resume, safe retention."""

from d9d.core.checkpoint.checkpointer import (
    CheckpointLoadError,
    JobCheckpointer,
    ModelAndOptimizer,
    legacy_rng_file,
    load_model_weights,
    rng_file,
)
from d9d.core.checkpoint.durable import fsync_dir, fsync_tree, make_private_dir, write_durable
from d9d.core.checkpoint.layout import MARKER, checkpoint_dir, is_complete, latest_complete, list_checkpoints, prune
from d9d.core.checkpoint.rng import RngStateError, capture_rng_state, restore_rng_state

__all__ = [
    "MARKER",
    "CheckpointLoadError",
    "JobCheckpointer",
    "ModelAndOptimizer",
    "RngStateError",
    "capture_rng_state",
    "checkpoint_dir",
    "fsync_dir",
    "fsync_tree",
    "is_complete",
    "latest_complete",
    "legacy_rng_file",
    "list_checkpoints",
    "load_model_weights",
    "make_private_dir",
    "prune",
    "restore_rng_state",
    "rng_file",
    "write_durable",
]
