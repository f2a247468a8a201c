"""One writer per shared file: run an action on the first rank of the default group, and let every rank go on only
once it is done, with its outcome."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


def on_first_rank(action: Callable[[], object]) -> None:
    """Run `action` in this process, or on global rank 0 only inside a process group (collective: every rank calls
    it); what `action` returns is dropped. Every rank returns once it is done; if it raised, every rank raises the
    same error, so none goes on to read a file that was never written or waits for one that never comes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        action()
        return
    outcome: list[BaseException | None] = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - handed to every rank below, then raised there
            outcome[0] = error
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]
