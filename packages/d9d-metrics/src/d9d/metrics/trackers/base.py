"""What every tracker shares: a run identity, main-process-only writing, flattened hyperparameters, lazy opening.

A tracker satisfies d9d-core's `Tracker` protocol (`run_id`, `resume(run_id, step)`, `log`, `checkpointed`) and
adds `close()`. Built with `enabled=False` (every rank but the main one) it never touches its backend, so only the
main process writes. The backend run is opened lazily, on the first call that needs it, so a resumed job reattaches
to the checkpointed run instead of creating a new one first.
"""

from __future__ import annotations

import importlib.util
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HParamValue = str | int | float | bool | None


def flatten_hparams(hparams: Mapping[str, Any], separator: str = ".") -> dict[str, HParamValue]:
    """`{"model": {"layers": 2}, "lrs": [1, 2]}` -> `{"model.layers": 2, "lrs.0": 1, "lrs.1": 2}`; paths and other
    objects become strings, so every backend can store every value."""
    flat: dict[str, HParamValue] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(f"{prefix}{separator}{key}" if prefix else str(key), item)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                visit(f"{prefix}{separator}{index}" if prefix else str(index), item)
        elif value is None or isinstance(value, str | int | float | bool):
            flat[prefix] = value
        elif isinstance(value, Path):
            flat[prefix] = str(value)
        else:
            flat[prefix] = repr(value)

    visit("", hparams)
    return flat


def require_backend(module: str, extra: str) -> None:
    """Fail at build time, on every rank, with the install command when an optional backend is missing."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"the {extra!r} tracker needs the {module!r} package, which is not installed; "
            f"install it with: pip install 'd9d-metrics[{extra}]'"
        )


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class BaseTracker(ABC):
    def __init__(self, *, enabled: bool = True, hparams: Mapping[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.hparams = flatten_hparams(hparams or {})
        self._resumed_step: int | None = None

    @property
    @abstractmethod
    def run_id(self) -> str: ...

    def resume(self, run_id: str, step: int) -> None:
        """Continue `run_id`; history after `step` was written by the dead attempt and is logged again."""
        self._resumed_step = step
        self._resume(run_id, step)

    @abstractmethod
    def _resume(self, run_id: str, step: int) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.enabled:
            self._log(step, {name: float(value) for name, value in metrics.items()})

    @abstractmethod
    def _log(self, step: int, metrics: dict[str, float]) -> None: ...

    def checkpointed(self, step: int) -> None:
        """The checkpoint of `step` is complete; make history up to it durable."""
        if self.enabled:
            self._checkpointed(step)

    def _checkpointed(self, step: int) -> None:
        del step

    def close(self) -> None:
        """The job ends normally: write out everything logged and release the backend."""
        if self.enabled:
            self._close()

    def _close(self) -> None:
        return None


class NullTracker(BaseTracker):
    """Logs nothing (the `none` config)."""

    def __init__(self, *, run_id: str | None = None) -> None:
        super().__init__(enabled=False)
        self._run_id = run_id or new_run_id()

    @property
    def run_id(self) -> str:
        return self._run_id

    def _resume(self, run_id: str, step: int) -> None:
        self._run_id = run_id

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        return None
