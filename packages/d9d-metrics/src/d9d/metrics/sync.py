"""Asynchronous synchronisation of many metrics: one all-reduce per reduction kind, fetched when logged.

`start_sync` flattens the states of every metric into one float64 buffer per reduction (sum, min, max), starts
`all_reduce(..., async_op=True)` on copies and returns at once, so training continues while the reduction runs;
`MetricSync.results()` waits and computes. The same code path runs on gloo (CPU tensors) and NCCL (CUDA tensors:
call `metric.to(device)` first). The local states are untouched, so a metric keeps accumulating after a sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from d9d.metrics.metric import Metric, Reduce

_OPS = {Reduce.SUM: dist.ReduceOp.SUM, Reduce.MIN: dist.ReduceOp.MIN, Reduce.MAX: dist.ReduceOp.MAX}


class MetricSync:
    """An in-flight synchronisation; `results()` waits for it and computes every metric from the reduced states."""

    def __init__(self, metrics: Mapping[str, Metric[Any]], group: dist.ProcessGroup | None) -> None:
        self._metrics = dict(metrics)
        # Sorted names: every rank must lay its buffer out identically.
        self._layout: dict[Reduce, list[tuple[str, str, torch.Size]]] = {op: [] for op in Reduce}
        pieces: dict[Reduce, list[torch.Tensor]] = {op: [] for op in Reduce}
        for metric_name in sorted(self._metrics):
            metric = self._metrics[metric_name]
            specs = metric.specs()
            for state_name in sorted(specs):
                state = metric.states[state_name]
                self._layout[specs[state_name]].append((metric_name, state_name, state.shape))
                pieces[specs[state_name]].append(state.reshape(-1))
        self._buffers: dict[Reduce, torch.Tensor] = {}
        self._works: list[Any] = []
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        for op, tensors in pieces.items():
            if not tensors:
                continue
            buffer = torch.cat(tensors)  # a copy: the local states stay as they are
            self._buffers[op] = buffer
            if distributed:
                work = dist.all_reduce(buffer, op=_OPS[op], group=group, async_op=True)
                if work is not None:
                    self._works.append(work)
        self._results: dict[str, Any] | None = None

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []

    def synced_states(self) -> dict[str, dict[str, torch.Tensor]]:
        self.wait()
        states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self._metrics}
        for op, entries in self._layout.items():
            offset = 0
            for metric_name, state_name, shape in entries:
                size = shape.numel()
                states[metric_name][state_name] = self._buffers[op][offset : offset + size].reshape(shape)
                offset += size
        return states

    def results(self) -> dict[str, Any]:
        if self._results is None:
            states = self.synced_states()
            self._results = {name: metric.compute_from(states[name]) for name, metric in self._metrics.items()}
        return self._results


def start_sync(metrics: Mapping[str, Metric[Any]], group: dist.ProcessGroup | None = None) -> MetricSync:
    """Start reducing `metrics` over `group` without waiting; every rank must call it with the same names (one
    process without a process group: the results are the local ones). Pass the data-parallel group (`dp_group(ctx)`
    from `d9d.core.loop.reduce`); the default, the whole world, counts data twice where ranks share it (TP, PP)."""
    return MetricSync(metrics, group)


def sync(metric: Metric[Any], group: dist.ProcessGroup | None = None) -> Any:
    """Blocking convenience for one metric: the result over every rank of `group`."""
    return start_sync({"metric": metric}, group).results()["metric"]
