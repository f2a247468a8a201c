"""Host work of one all-to-all dispatch + combine (forward and backward), the CPU proxy for design 0025's
host-bound forward: how many backend ops each phase launches and how long the host spends, on `--ranks` gloo ranks.

    python bench/dispatch_host_ops.py [--ranks 2] [--tokens 512] [--hidden 64] [--experts 64] [--top-k 8]
    python bench/dispatch_host_ops.py --dispatcher all_to_all_capacity [--capacity-factor 2.0]   # design 0029

Op counts are every aten/c10d op that reaches a backend kernel (a `TorchDispatchMode` below autograd), per rank,
for the dispatch forward, the combine forward and the backward of both; they are deterministic, so compare them
across versions. Host microseconds are medians over `--repeats` iterations of the same tiny problem on the CPU, so
they include gloo's latency and the CPU kernels' work: a noisy proxy (only the op counts transfer to a GPU's
launch-bound forward). Every rank's routing is random with no capacity drop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.kernels.expert_dispatch import AllToAllCapacityDispatcher, AllToAllDispatcher, TokenDispatcher


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _routing(args: argparse.Namespace, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator, requires_grad=True)
    scores = torch.rand(args.tokens, args.experts, generator=generator)
    weights, indices = scores.topk(args.top_k, dim=-1)
    weights.requires_grad_(True)  # noqa: FBT003 - torch's signature
    return x, indices, weights


def _step(dispatcher: TokenDispatcher, args: argparse.Namespace, rank: int, seed: int) -> dict[str, float]:
    x, indices, weights = _routing(args, rank, seed)
    dist.barrier()
    times: dict[str, float] = {}
    start = time.perf_counter()
    dispatched = dispatcher.dispatch(x, indices, weights)
    times["dispatch"] = time.perf_counter() - start
    rows = dispatched.rows * 2.0  # the experts: one op outside the measured phases
    start = time.perf_counter()
    out = dispatcher.combine(rows, dispatched)
    times["combine"] = time.perf_counter() - start
    loss = out.sum()
    start = time.perf_counter()
    loss.backward()
    times["backward"] = time.perf_counter() - start
    return times


def _count(dispatcher: TokenDispatcher, args: argparse.Namespace, rank: int) -> dict[str, Counter[str]]:
    x, indices, weights = _routing(args, rank, 0)
    counts: dict[str, Counter[str]] = {}
    with _CountOps() as mode:
        dispatched = dispatcher.dispatch(x, indices, weights)
    counts["dispatch"] = mode.ops
    rows = dispatched.rows * 2.0
    with _CountOps() as mode:
        out = dispatcher.combine(rows, dispatched)
    counts["combine"] = mode.ops
    loss = out.sum()
    with _CountOps() as mode:
        loss.backward()
    counts["backward"] = mode.ops
    return counts


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)
    group = dist.group.WORLD
    assert group is not None
    dispatcher: TokenDispatcher = (
        AllToAllCapacityDispatcher(group, args.experts, args.capacity_factor)
        if args.dispatcher == "all_to_all_capacity"
        else AllToAllDispatcher(group, args.experts)
    )
    counts = _count(dispatcher, args, rank)
    samples: dict[str, list[float]] = {"dispatch": [], "combine": [], "backward": []}
    for seed in range(args.warmup + args.repeats):
        times = _step(dispatcher, args, rank, seed)
        if seed >= args.warmup:
            for phase, seconds in times.items():
                samples[phase].append(seconds)
    if rank == 0:
        print(f"| phase | backend ops (rank 0) | host us, median of {args.repeats} |")
        print("|---|---|---|")
        for phase in ("dispatch", "combine", "backward"):
            median_us = statistics.median(samples[phase]) * 1e6
            print(f"| {phase} | {sum(counts[phase].values())} | {median_us:.0f} |")
        for phase in ("dispatch", "combine", "backward"):
            ops = ", ".join(f"{name} x{n}" for name, n in sorted(counts[phase].items()))
            print(f"# {phase}: {ops}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--dispatcher", default="all_to_all", choices=["all_to_all", "all_to_all_capacity"])
    parser.add_argument("--capacity-factor", type=float, default=2.0, help="all_to_all_capacity only")
    args = parser.parse_args()
    mp.spawn(_worker, args=(args,), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
