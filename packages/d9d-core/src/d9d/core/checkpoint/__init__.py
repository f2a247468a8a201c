"""Job checkpoints: DCP folders with a completion marker, newest-complete resume, safe retention."""

from d9d.core.checkpoint.checkpointer import JobCheckpointer, ModelAndOptimizer, load_model_weights
from d9d.core.checkpoint.layout import MARKER, checkpoint_dir, is_complete, latest_complete, list_checkpoints, prune
from d9d.core.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "MARKER",
    "JobCheckpointer",
    "ModelAndOptimizer",
    "capture_rng_state",
    "checkpoint_dir",
    "is_complete",
    "latest_complete",
    "list_checkpoints",
    "load_model_weights",
    "prune",
    "restore_rng_state",
]
