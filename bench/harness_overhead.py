"""Cost of one multi-rank test with d9d's fork-based harness, against starting ranks with `torch.multiprocessing`.

Usage: python bench/harness_overhead.py [--repeats N] [--skip-spawn]

Each test body builds the DistributedContext (all five mesh domains) and runs a variable-shape all-gather, like
tests/core/test_context.py and tests/core/test_ops.py. Prints a markdown table of median/min/max seconds per test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def body() -> int:
    from d9d.core.dist import DistributedContext, MeshDegrees
    from d9d.core.ops import all_gather_variable_shape

    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1))
    rows = all_gather_variable_shape(torch.ones(ctx.rank + 1, 4))
    return len(rows)


def spawn_rank(rank: int, world_size: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    os.environ["D9D_DEVICE"] = "cpu"
    body()
    dist.destroy_process_group()


def time_spawn(world_size: int, workdir: Path, index: int) -> float:
    import torch.multiprocessing as mp

    start = time.perf_counter()
    mp.start_processes(
        spawn_rank,
        args=(world_size, str(workdir / f"store-{world_size}-{index}")),
        nprocs=world_size,
        start_method="spawn",
    )
    return time.perf_counter() - start


def summary(samples: list[float]) -> str:
    return f"{statistics.median(samples):.2f} | {min(samples):.2f} | {max(samples):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-spawn", action="store_true")
    args = parser.parse_args()
    from d9d.core.testing import run_on_ranks, warm_up_distributed

    start = time.perf_counter()
    warm_up_distributed()
    print(f"one-off warm-up in the parent: {time.perf_counter() - start:.2f} s\n")
    print("| launcher | ranks | median s | min s | max s |")
    print("|---|---|---|---|---|")
    for world_size in (1, 2, 4, 8):
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            assert run_on_ranks(world_size, body) == [world_size] * world_size
            samples.append(time.perf_counter() - start)
        print(f"| d9d fork harness | {world_size} | {summary(samples)} |", flush=True)
    if not args.skip_spawn:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            for world_size in (2, 4):
                samples = [time_spawn(world_size, Path(tmp), i) for i in range(min(args.repeats, 2))]
                print(f"| torch.multiprocessing spawn | {world_size} | {summary(samples)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
