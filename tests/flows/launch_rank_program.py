"""A stand-in rank program for the launcher tests, run by torchrun: `-m launch_rank_program DIR MODE`.

Each rank writes its pid to DIR/rank-R.pid, rank 0 reports progress lines, then by MODE: `finish` exits 0 after three
steps, `fail` exits 3 on rank 1, `wait` runs until SIGTERM and then writes DIR/rank-R.stopped (what the Trainer
does: finish the step, checkpoint, exit), `slow-stop` does the same but takes D9D_TEST_STOP_SECONDS (default 35: longer
than the 30 s torchrun allows its ranks after forwarding a signal) to "checkpoint", `stubborn` ignores SIGTERM (so
only SIGKILL ends it). `hang` and `sigkill` join a gloo group (collective timeout D9D_TEST_TIMEOUT seconds,
default 5) in which rank 1 hangs (ignoring SIGTERM) or SIGKILLs itself while rank 0 waits in a barrier.
"""

import os
import signal
import sys
import time
from pathlib import Path

from d9d.flows.jobs.launch import emit_progress, prepare_rank


def hang_forever() -> None:
    while True:  # a rank stuck outside any collective (a deadlock, a dead file system): ignores SIGTERM
        time.sleep(0.1)


def lost_rank(rank: int, mode: str) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=float(os.environ.get("D9D_TEST_TIMEOUT", "5")))
    dist.init_process_group("gloo", timeout=timeout)
    if rank == 1:
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        hang_forever()
    dist.barrier()  # times out (or fails at once) without rank 1
    return 0


def main() -> int:
    prepare_rank()
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    stop = {"asked": False}
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))
    (out / f"rank-{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        emit_progress({"event": "started", "step": 0, "total": 3})
    if mode == "finish":
        for step in (1, 2, 3):
            if rank == 0:
                emit_progress({"event": "step", "step": step, "total": 3, "loss": 1.0 / step})
            print(f"rank {rank} step {step}", flush=True)
        return 0
    if mode == "fail":
        return 3 if rank == 1 else 0
    if mode in ("hang", "sigkill"):
        return lost_rank(rank, mode)
    while not stop["asked"]:
        time.sleep(0.05)
    if mode == "slow-stop":
        (out / f"rank-{rank}.stopping").write_text(str(time.time()))
        time.sleep(float(os.environ.get("D9D_TEST_STOP_SECONDS", "35")))
    (out / f"rank-{rank}.stopped").write_text("checkpointed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
