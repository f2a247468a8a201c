"""Save and load job checkpoints with torch Distributed Checkpoint (DCP), complete only once marked.

The order of a save: rank 0 removes a stale completion marker of the same step (then the rest of that old folder)
and creates the folder owner-only; every rank writes its DCP shards (DCP fsyncs them) and its RNG state as JSON
(written durably); a barrier; rank 0 fsyncs every file and directory of the folder, then writes the completion
marker durably; a barrier; rank 0 prunes old checkpoints. A rank killed or a machine losing power anywhere before
the marker leaves a folder that is never loaded. Loading reads the state back in place (model and optimizer
through DCP's `set_state_dict` so DTensor shards are redistributed for the current layout); `load_newest` falls
back to the previous complete checkpoint, with a warning, when the newest one cannot be loaded on some rank.

Trust: RNG and loop state are JSON and never unpickled. DCP itself reads its `.metadata` (and non-tensor values)
with pickle, so a job checkpoint is the job's own trusted artifact: its folders are created owner-only (0o700);
weights from anywhere else come in through safetensors (see docs/reliability.md).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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

from d9d.core.checkpoint.durable import fsync_dir, fsync_tree, make_private_dir, write_durable
from d9d.core.checkpoint.layout import MARKER, checkpoint_dir, is_complete, latest_complete, list_checkpoints, prune
from d9d.core.checkpoint.rng import RngStateError, capture_rng_state, restore_rng_state

T = TypeVar("T")
RNG_DIR = "rng"
_LOG = logging.getLogger(__name__)


class CheckpointLoadError(RuntimeError):
    """No complete checkpoint could be loaded (the message lists each one tried and why it failed)."""


def rng_file(path: Path, rank: int) -> Path:
    return path / RNG_DIR / f"rank-{rank:05d}.json"


def legacy_rng_file(path: Path, rank: int) -> Path:
    """Where earlier d9d-core versions stored a rank's RNG state, as a pickle (never read now)."""
    return path / RNG_DIR / f"rank-{rank:05d}.pt"


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
    """Writes `step-XXXXXXXX` checkpoints under `root`, keeps the newest `keep_last` complete ones.

    `device`: where the ranks agree on a load's success (the process group's device: CUDA for NCCL).
    """

    def __init__(self, root: Path, *, keep_last: int, rank: int, device: torch.device | None = None) -> None:
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.device = device

    def latest(self) -> Path | None:
        return latest_complete(self.root)

    def save(self, step: int, state: dict[str, Any], *, before_marker: Callable[[Path], None] | None = None) -> Path:
        """Write `state` (values may be `Stateful`) as the checkpoint of `step`; returns its folder.

        `before_marker(path)` runs on every rank after all ranks wrote their files and before the marker; files it
        writes there should use `write_durable` (rank 0 also fsyncs the whole folder before the marker).
        """
        path = checkpoint_dir(self.root, step)
        if self.rank == 0:
            make_private_dir(self.root)
            _clear_stale(path)
            make_private_dir(path)
            make_private_dir(path / RNG_DIR)
        _barrier()
        dcp_save(state, checkpoint_id=path)
        write_durable(rng_file(path, self.rank), json.dumps(capture_rng_state()).encode("utf-8"))
        _barrier()
        if before_marker is not None:
            before_marker(path)
        if self.rank == 0:
            fsync_tree(path)
            write_durable(path / MARKER, f"{step}\n".encode())
            prune(self.root, self.keep_last)
            fsync_dir(self.root)
        _barrier()
        return path

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Load `path` into `state` in place; restore this rank's RNG if the checkpoint has this rank's file.

        Raises:
            RngStateError: this rank's RNG file is not the JSON this checkpointer writes (or is a legacy pickle).
        """
        legacy = legacy_rng_file(path, self.rank)
        if legacy.is_file() and not rng_file(path, self.rank).is_file():
            raise RngStateError(
                f"{legacy} holds RNG state as a pickle (written by an earlier d9d-core), which d9d no longer "
                f"unpickles. To resume from this checkpoint anyway, delete {path / RNG_DIR} (the model, optimizer, "
                "data position and LR schedule still resume; the random streams restart from the seed), or delete "
                f"{path} to resume from an older checkpoint or start afresh."
            )
        dcp_load(state, checkpoint_id=path)
        current = rng_file(path, self.rank)
        if current.is_file():
            try:
                stored = json.loads(current.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError) as error:
                raise RngStateError(f"{current} is not JSON RNG state ({error}); the file is damaged") from error
            try:
                restore_rng_state(stored)
            except RngStateError as error:
                raise RngStateError(f"{current}: {error}") from error

    def load_newest(self, state: dict[str, Any], read_extra: Callable[[Path], T]) -> tuple[Path, T] | None:
        """Load the newest complete checkpoint that every rank can load, falling back to older complete ones.

        `read_extra(path)` reads what else the caller keeps in the folder (e.g. the loop's JSON state); it counts
        as part of the load. All ranks agree (one all-reduce per attempt) so they resume from the same step. A
        failed attempt is logged as a warning naming the folder and the error. Returns None when there is no
        complete checkpoint.

        Raises:
            CheckpointLoadError: complete checkpoints exist but none could be loaded (each one's error listed).
        """
        candidates = [path for _, path in list_checkpoints(self.root) if is_complete(path)]
        failures: list[str] = []
        for path in reversed(candidates):
            error: BaseException | None = None
            extra: T | None = None
            try:
                self.load(path, state)
                extra = read_extra(path)
            except (Exception, CheckpointException) as caught:  # noqa: BLE001 - any failure: try the previous one
                error = caught
            if _all_ranks_succeeded(error is None, self.device):
                assert error is None
                return path, extra  # type: ignore[return-value]
            reason = _summary(error) if error is not None else "another rank failed to load it"
            failures.append(f"{path}: {reason}")
            message = f"rank {self.rank}: cannot load checkpoint {path} ({reason}); trying the previous complete one"
            _LOG.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        if failures:
            raise CheckpointLoadError(
                "no complete checkpoint under "
                f"{self.root} could be loaded:\n  " + "\n  ".join(failures) + "\nrepair or delete the damaged "
                "folders (a folder without its COMPLETE marker is ignored), then resume"
            )
        return None


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


def _clear_stale(path: Path) -> None:
    """Before a step is rewritten: remove its old marker first (durably), so a crash mid-rewrite leaves a folder
    that is never taken as complete, then the old files (another world size may have written other shard names)."""
    if not path.exists():
        return
    (path / MARKER).unlink(missing_ok=True)
    fsync_dir(path)
    shutil.rmtree(path)
    fsync_dir(path.parent)


def _summary(error: BaseException) -> str:
    """One line: DCP's `CheckpointException` carries each failing rank's whole traceback; its last line says what."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def _all_ranks_succeeded(succeeded: bool, device: torch.device | None) -> bool:
    flag = torch.tensor([1.0 if succeeded else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
