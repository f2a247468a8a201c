"""SIGTERM handling: remember the signal; the loop agrees on it across ranks at the end of a step."""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist


class PreemptionFlag:
    """Installs a SIGTERM handler (main thread only) that sets a flag instead of killing the process."""

    def __init__(self) -> None:
        self._raised = False
        self._previous: object = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._raised = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank got SIGTERM (one all-reduce), so all stop after the same step."""
        flag = torch.tensor([1.0 if self._raised else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
