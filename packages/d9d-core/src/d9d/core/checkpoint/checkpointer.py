"""Save and load job checkpoints with torch Distributed Checkpoint (DCP), complete only once marked.

The order of a save: every rank writes its DCP shards and its RNG file; a barrier; rank 0 writes the completion
marker; a barrier; rank 0 prunes old checkpoints. A rank killed anywhere before the marker leaves a folder that is
never loaded. Loading reads the state back in place (model and optimizer through DCP's `set_state_dict` so DTensor
shards are redistributed for the current layout).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from d9d.core.checkpoint.layout import MARKER, checkpoint_dir, latest_complete, prune
from d9d.core.checkpoint.rng import capture_rng_state, restore_rng_state


class ModelAndOptimizer(Stateful):
    """DCP view of a (possibly sharded) model and its optimizer, in layout-independent (fully qualified) form.

    `trainable_only`: the model part holds only parameters with `requires_grad` (e.g. fine-tuning adapters); the
    frozen rest is left as it is on load, so it must come from elsewhere (the base checkpoint).
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer, *, trainable_only: bool = False) -> None:
        self._model, self._optimizer = model, optimizer
        self._options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self._model, self._optimizer, options=self._options)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self._model,
            self._optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
            options=self._options,
        )


class JobCheckpointer:
    """Writes `step-XXXXXXXX` checkpoints under `root`, keeps the newest `keep_last` complete ones."""

    def __init__(self, root: Path, *, keep_last: int, rank: int) -> None:
        self.root = root
        self.keep_last = keep_last
        self.rank = rank

    def latest(self) -> Path | None:
        return latest_complete(self.root)

    def save(self, step: int, state: dict[str, Any], *, before_marker: Callable[[Path], None] | None = None) -> Path:
        """Write `state` (values may be `Stateful`) as the checkpoint of `step`; returns its folder."""
        path = checkpoint_dir(self.root, step)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        _barrier()
        dcp_save(state, checkpoint_id=path)
        (path / "rng").mkdir(exist_ok=True)
        torch.save(capture_rng_state(), path / "rng" / f"rank-{self.rank:05d}.pt")
        _barrier()
        if before_marker is not None:
            before_marker(path)
        if self.rank == 0:
            (path / MARKER).write_text(f"{step}\n", encoding="utf-8")
            prune(self.root, self.keep_last)
        _barrier()
        return path

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Load `path` into `state` in place; restore this rank's RNG if the checkpoint has this rank's file."""
        dcp_load(state, checkpoint_id=path)
        rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
        if rng_file.is_file():
            # The job's own trusted artifact (NumPy's RNG state is not a weights-only type).
            restore_rng_state(torch.load(rng_file, weights_only=False))


def load_model_weights(path: Path, model: nn.Module, *, names: Collection[str] | None = None) -> None:
    """Load only the model of a job checkpoint (e.g. for evaluation), resharded for the model's current layout.

    `names`: load only these state names and leave the rest as it is (e.g. a base model's checkpoint into a model
    with added adapters); None: every name of the model, each must be in the checkpoint.
    """
    model_state = get_model_state_dict(model)
    if names is not None:
        unknown = sorted(set(names) - model_state.keys())
        if unknown:
            raise KeyError(f"names {unknown[:5]} are not in the model's state ({len(model_state)} names)")
        model_state = {name: value for name, value in model_state.items() if name in names}
    state = {"app": {"model": model_state}}
    dcp_load(state, checkpoint_id=path)
    set_model_state_dict(model, state["app"]["model"], options=StateDictOptions(strict=names is None))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
