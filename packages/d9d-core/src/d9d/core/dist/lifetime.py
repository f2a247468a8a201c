"""A rank never outlives its launcher: when torchrun dies (SIGKILL, OOM killer), the kernel kills its ranks too.

torchrun starts each rank in a session of its own, so nothing else reaches them once torchrun is gone: they would
run on (writing checkpoints beside a rerun) or hang in a collective for good. Linux's `PR_SET_PDEATHSIG` asks the
kernel to send a signal when the parent exits; SIGKILL, because the parent is gone and nothing waits for a graceful
stop (a checkpoint cut short is never marked complete, so no data is lost). torchrun starts ranks from its main
thread, whose exit is the process's.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun (and torch elastic agents) for the ranks they start


def die_with_launcher() -> bool:
    """Have this process SIGKILLed when its parent exits (Linux); returns whether that is now arranged."""
    if sys.platform != "linux":
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def launched_by_torchrun() -> bool:
    return LAUNCHER_ENV in os.environ
