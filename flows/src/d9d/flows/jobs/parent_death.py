"""`python -m d9d.flows.jobs.parent_death PARENT_PID SIGNAL -- COMMAND...`: run COMMAND so that it gets SIGNAL when
the process PARENT_PID dies, however it dies (`kill -9` included), so that no process of a run outlives it.

Linux's `prctl(PR_SET_PDEATHSIG)` asks the kernel to deliver the signal; it survives `exec`, so this module sets it
and then becomes COMMAND. (Python's `preexec_fn` could do the same without the extra exec, but it is unsafe in a
process that runs threads, as Prefect's do.) Elsewhere the command runs unguarded. No Prefect here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def guarded_command(command: Sequence[str], *, signum: int = signal.SIGTERM) -> list[str]:
    """`command` wrapped so that it receives `signum` when this process dies. The wrapper runs as a file, not a
    module: it needs nothing but the standard library, whatever PYTHONPATH the command is given."""
    script = str(Path(__file__).resolve())
    return [sys.executable, script, str(os.getpid()), signal.Signals(signum).name, "--", *command]


def die_with_parent(parent: int, signum: int) -> bool:
    """Ask for `signum` when the parent dies; False where the platform cannot. Exits at once if `parent` is gone."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # it died before prctl took effect: nobody would signal us
        os.kill(os.getpid(), signum)
    return True


def main(argv: Sequence[str]) -> int:  # noqa: RET503 - exec replaces the process
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: python -m d9d.flows.jobs.parent_death PARENT_PID SIGNAL -- COMMAND...\n")
        return 2
    die_with_parent(int(argv[0]), signal.Signals[argv[1]])
    os.execvp(argv[3], list(argv[3:]))  # noqa: S606 - the launcher's own argument list, no shell


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
