"""SIGTERM handling: remember the signal; the loop agrees on it across ranks at the end of a step.

The agreement runs on the host: a plain bool in one process, else a MAX all-reduce of a CPU tensor over a gloo
group (`DistributedContext.control_group`). A device tensor would need a device-to-host read, which waits for every
kernel queued before it (the optimizer step), so the host could not prepare the next step while the device works.
"""

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

    def agreed(self, group: dist.ProcessGroup | None) -> bool:
        """True on every rank if any rank got SIGTERM, so all stop after the same step.

        Args:
            group: every rank, moving CPU tensors (`DistributedContext.control_group`); `None` in a world of one,
                where the answer is this process's own flag (no tensor, no collective).
        """
        if group is None:
            return self._raised
        flag = torch.tensor([1 if self._raised else 0], dtype=torch.int32)  # on the CPU: never waits for a device
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
