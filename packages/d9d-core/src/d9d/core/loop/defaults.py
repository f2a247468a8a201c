"""Single-process defaults for the injected protocols."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


class NoGradientSync:
    """Nothing to reduce: one process, or a model whose parallelisation reduces gradients itself."""

    def begin_step(self, num_microbatches: int) -> None:
        del num_microbatches

    def wait(self) -> None:
        return None


def clip_grad_norm_torch(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_`, the norm returned as a plain tensor (use d9d.parallel's on hybrid meshes)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class JsonlTracker:
    """A local tracker: one JSON line per logged step in `<directory>/<run_id>.jsonl` (written by rank 0 only)."""

    def __init__(self, directory: Path, *, enabled: bool = True, run_id: str | None = None) -> None:
        self._directory = directory
        self._enabled = enabled
        self._run_id = run_id or uuid.uuid4().hex[:12]

    @property
    def run_id(self) -> str:
        return self._run_id

    def resume(self, run_id: str) -> None:
        self._run_id = run_id

    @property
    def path(self) -> Path:
        return self._directory / f"{self._run_id}.jsonl"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._enabled:
            return
        self._directory.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
