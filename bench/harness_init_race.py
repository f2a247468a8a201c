"""How often a multi-rank test with an empty body fails while its gloo group is being created (the harness's
"connectFullMesh ... Connection closed by peer" flake), on a machine kept busy by `--load` spinning processes.

Usage: python bench/harness_init_race.py [--runs 600] [--world-size 4] [--load 2]

Each run forks `--world-size` ranks whose body only reads the world size (no collective): the case in which a rank
that finished early could destroy its group while a peer was still connecting. Prints runs, failures and seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch.distributed as dist

from d9d.core.testing import run_on_ranks


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs (0: an idle machine)")
    args = parser.parse_args()
    # The spinners start before any rank is forked and stop on their own: this process keeps no thread (the harness
    # refuses to fork a process with threads).
    budget = time.monotonic() + 3600
    spinners = [multiprocessing.get_context("fork").Process(target=_spin, args=(budget,)) for _ in range(args.load)]
    for spinner in spinners:
        spinner.start()
    failures, started = 0, time.perf_counter()
    try:
        for _ in range(args.runs):
            try:
                run_on_ranks(args.world_size, dist.get_world_size)
            except AssertionError as error:  # RankFailure / RankTimeout carry every failing rank's traceback
                failures += 1
                print(str(error).splitlines()[-1][:160])
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    seconds = time.perf_counter() - started
    print(f"runs={args.runs} world_size={args.world_size} load={args.load} failures={failures} seconds={seconds:.1f}")


if __name__ == "__main__":
    main()
