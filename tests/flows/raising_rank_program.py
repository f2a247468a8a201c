"""A stand-in rank program that fails as a real one does: with a process group (so torch prefixes its traceback's
lines with `[rank1]: `), rank 1 raises deep in a call stack, rank 0 waits for it."""

import os
import sys
import time


def check_schedule(steps: int) -> None:
    raise ValueError(f"phase 1 (mode='steps', steps=20) ends at step 21, past total_steps={steps}")


def main() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if int(os.environ["RANK"]) == 1:
        print("rank 1 is about to fail", flush=True)
        check_schedule(10)
    time.sleep(30)  # torchrun stops this rank once rank 1 has failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
