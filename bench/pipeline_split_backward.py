"""One pipeline stage's split backward against its full backward: ops, autograd calls, host and device time.

A middle stage (no embedding, no head) of the dense anchor (bench/anchor_models.py): `--layers` decoder
layers (8 = a stage of the 32-layer anchor at pp=4; 4 = one of ZBV's two stages there), 1 x 4096 tokens, bf16.
For full backward (`B`) and both split backwards, the weight-gradient store (`I store`, `W store`: what the
executor runs by default, design note 0024) and the graph walk (`I graph`, `W graph`: the fallback,
`D9D_PIPELINE_SPLIT_BACKWARD=graph`): the aten ops autograd ran (matmuls and attention backwards counted apart; one
untimed pass under a dispatch mode), the autograd calls the graph walk's `W` makes and the work items the store's
`W` runs, the host time of the call (the Python and autograd-engine work that must stay ahead of the GPU) and the
device time (CUDA events; equal to the host time on CPU). A split must cost what the full backward costs: I + W
matmuls = B matmuls, no attention backward in W, and I + W host time close to B's.

    python bench/pipeline_split_backward.py                       # one GPU, the anchor's stage (about 30 s)
    python bench/pipeline_split_backward.py --layers 4
    D9D_DEVICE=cpu python bench/pipeline_split_backward.py --tiny  # seconds on CPU; node counts as on GPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anchor_models import DENSE, tiny
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM
from d9d.pipeline import (
    PipelineStage,
    backward_input,
    backward_weight,
    deferring_weight_gradients,
    store_backward_input,
    store_backward_weight,
)

MATMULS = {"mm", "bmm", "addmm", "_grouped_mm"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, int]:
        return {
            "ops": sum(self.counts.values()),
            "matmuls": sum(count for name, count in self.counts.items() if name in MATMULS),
            "attention_backwards": sum(
                count for name, count in self.counts.items() if "attention" in name and "backward" in name
            ),
        }


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, host seconds, device seconds) of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        result = fn()
        host = time.perf_counter() - began
        stop.record()
        torch.cuda.synchronize()
        return result, host, start.elapsed_time(stop) * 1e-3
    began = time.perf_counter()
    result = fn()
    host = time.perf_counter() - began
    return result, host, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    device = torch.device(os.environ.get("D9D_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq = 64 if args.tiny else 4096
    params = (tiny(DENSE) if args.tiny else DENSE).model_copy(update={"num_layers": 3 * args.layers})
    with torch.device("meta"):
        module = Qwen3DenseForCausalLM(params, config=DecoderConfig(), stage=PipelineStage(1, 3))
    materialize_(module, device)
    module = module.to(dtype)
    weights = [param for param in module.parameters() if param.requires_grad]
    torch.manual_seed(0)

    def forward(*, deferring: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(1, seq, params.hidden_size, device=device, dtype=dtype, requires_grad=True)
        with deferring_weight_gradients(deferring):  # as the executor marks the forwards the store will split
            out = module(None, hidden_states=x).hidden_states
        return x, out, torch.randn_like(out)

    def passes(counters: dict[str, contextlib.AbstractContextManager[object]]) -> tuple[dict[str, Any], int, int]:
        """One full backward, then each split backward of a fresh forward: {pass: (host, device)}, the graph walk's
        W autograd calls, the store's W work items."""
        x, out, grad = forward()
        with counters["B"]:
            _, host, dev = timed(device, functools.partial(torch.autograd.backward, [out], [grad]))
        times = {"B": (host, dev)}
        module.zero_grad(set_to_none=True)
        x, out, grad = forward(deferring=True)
        with counters["I store"]:
            (_, store), host, dev = timed(device, functools.partial(store_backward_input, [out], [grad], [x]))
        times["I store"] = (host, dev)
        del out
        with counters["W store"]:
            items, host, dev = timed(device, functools.partial(store_backward_weight, store))
        times["W store"] = (host, dev)
        module.zero_grad(set_to_none=True)
        x, out, grad = forward()
        with counters["I graph"]:
            (_, work), host, dev = timed(device, functools.partial(backward_input, [out], [grad], [x], weights))
        times["I graph"] = (host, dev)
        calls = work.num_calls
        del out  # as the executor does: only the work holds the graph until W
        with counters["W graph"]:
            _, host, dev = timed(device, functools.partial(backward_weight, work))
        times["W graph"] = (host, dev)
        module.zero_grad(set_to_none=True)
        return times, calls, items

    names = ("B", "I store", "W store", "I graph", "W graph")
    counters = {name: OpCounter() for name in names}
    _, calls, items = passes(dict(counters))  # untimed: counts the ops (and warms up)
    counts = {name: counter.summary() for name, counter in counters.items()}
    passes({name: contextlib.nullcontext() for name in counters})  # second warm-up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(args.repeats):
        times, _, _ = passes({name: contextlib.nullcontext() for name in counters})
        for name, (host, dev) in times.items():
            samples[name].append((host, dev))
    rows = []
    print(
        f"# {device} {dtype} middle stage of {args.layers} layers, seq {seq}; "
        f"W store runs {items} work items, W graph makes {calls} autograd calls"
    )
    print("| pass | ops | matmuls | attention backwards | host ms | device ms |")
    print("|---|---|---|---|---|---|")
    for name in names:
        host = statistics.median(h for h, _ in samples[name]) * 1e3
        dev = statistics.median(d for _, d in samples[name]) * 1e3
        row = {
            "pass": name, **counts[name], "host_ms": host, "device_ms": dev, "weight_calls": calls,
            "store_items": items,
        }  # fmt: skip
        rows.append(row)
        print(f"| {name} | {row['ops']} | {row['matmuls']} | {row['attention_backwards']} | {host:.2f} | {dev:.2f} |")
    if args.json:
        with Path(args.json).open("w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
