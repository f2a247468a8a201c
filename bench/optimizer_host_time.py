"""Host time of `StochasticAdamW(fused=True).step()`: the optimizer's own Python work per step, on CPU.

The registered fused steps are replaced by ones that do nothing, so what is timed is what the optimizer does around
its kernels (state lookup, step counts, seeds, shard coordinates, bucketing): the time a GPU idles when it exceeds
the update. Parameters: one per tensor of the dense anchor (311, shapes shrunk to at most 8 elements, since sizes
do not matter here), as plain tensors and as DTensors sharded over a one-rank gloo mesh (as FSDP gives them).

    python bench/optimizer_host_time.py            # per-tensor loop and multi-tensor buckets, both parameter kinds
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from anchor_models import DENSE, parameter_shapes
from d9d.core.optim import StochasticAdamW, fused_step


def _nothing(*args: Any, **kwargs: Any) -> None:
    """A fused step that does no arithmetic: only the optimizer's host work remains."""


def _params(distributed: bool) -> list[torch.nn.Parameter]:
    shapes = [tuple(min(dim, 2) for dim in shape) for shape in parameter_shapes(DENSE)]
    mesh = init_device_mesh("cpu", (1,)) if distributed else None
    params = []
    for shape in shapes:
        value = torch.zeros(shape, dtype=torch.bfloat16)
        param = torch.nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]) if mesh is not None else value)
        param.grad = torch.zeros_like(param)
        params.append(param)
    return params


def _time(step: Callable[[], Any], iters: int) -> tuple[float, float]:
    """(median, minimum) milliseconds: on a shared machine the minimum is the cost, the median adds others' load."""
    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as rendezvous:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
        try:
            print("| parameters | fused step | host ms per step (median) | (minimum) |")
            print("|---|---|---|---|")
            fused_step.register_fused_stochastic_adamw_step(_nothing)
            register_multi = getattr(fused_step, "register_fused_stochastic_adamw_multi_step", None)
            for distributed in (False, True):
                params = _params(distributed)
                kind = f"{len(params)} {'DTensors (Shard(0))' if distributed else 'tensors'}"
                for multi in (False, True):
                    if register_multi is None and multi:
                        continue  # a d9d-core without the multi-tensor extension point
                    if register_multi is not None:
                        register_multi(_nothing if multi else None)
                    optimizer = StochasticAdamW(params, fused=True)
                    median, minimum = _time(optimizer.step, args.iters)
                    print(f"| {kind} | {'multi-tensor' if multi else 'per-tensor'} | {median:.2f} | {minimum:.2f} |")
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
