"""One bucket of gradients: a flat buffer the gradients of several parameters live in, reduced as one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from d9d.parallel.replicate.marker import ReplicatedParameter, accumulation_placements, reduced_placements


@dataclass(frozen=True)
class BucketKey:
    """Gradients can share a bucket when they are reduced over the same ranks, on one device, in one dtype."""

    mesh: DeviceMesh
    reduce_dims: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype


class GradientBucket:
    """Gradients of `entries` as views of one flat buffer; all-reduced (sum) once every entry has accumulated.

    While a step accumulates, each parameter's `.grad` is a `Partial` DTensor whose local tensor *is* its view, so
    autograd accumulates micro-batches in place. `launch` starts an asynchronous all-reduce over the first reduce
    dimension; `finish` waits for it, reduces over any further dimensions, and re-labels the gradients with the
    parameters' own (`Replicate`) placements.
    """

    def __init__(self, key: BucketKey, entries: list[ReplicatedParameter]) -> None:
        self.key = key
        self.entries = entries
        sizes = [entry.param.to_local().numel() for entry in entries]
        self.buffer = torch.zeros(sum(sizes), dtype=key.dtype, device=key.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for entry, size in zip(entries, sizes, strict=True):
            self.views.append(self.buffer[offset : offset + size].view(entry.param.to_local().shape))
            offset += size
        # A gradient's two layouts, made once: wrapping a view with a ready spec costs ~3 us, `DTensor.from_local`
        # ~25 us (an autograd function and spec checks), twice per parameter per step (311 at the dense anchor).
        pairs = list(zip(entries, self.views, strict=True))
        self._accumulating = [
            _spec(entry, view, accumulation_placements(entry.param, entry.info)) for entry, view in pairs
        ]
        self._reduced = [_spec(entry, view, reduced_placements(entry.param, entry.info)) for entry, view in pairs]
        self._accumulations = [0] * len(entries)
        self._complete = 0
        self._expected = 0
        self._work: dist.Work | None = None
        self.launched = False

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def ready(self) -> bool:
        return self._complete == len(self.entries)

    def reset(self, num_microbatches: int) -> None:
        """Zero the buffer and expect `num_microbatches` accumulations per parameter."""
        if self._work is not None:  # a step abandoned after launching: let the reduction land before zeroing
            self._work.wait()
        self.buffer.zero_()
        self._accumulations = [0] * len(self.entries)
        self._complete = 0
        self._expected = num_microbatches
        self._work = None
        self.launched = False
        for entry, view, spec in zip(self.entries, self.views, self._accumulating, strict=True):
            entry.param.grad = _wrap(view, spec)

    def accumulated(self, position: int) -> None:
        """Record one accumulation of entry `position`'s gradient (called from its post-accumulate-grad hook)."""
        entry, view = self.entries[position], self.views[position]
        grad = entry.param.grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.data_ptr() != view.data_ptr():
                # Someone replaced or cleared `.grad` (e.g. optimizer.zero_grad()); take the gradient into the view.
                view.add_(local.to(view.dtype))
                entry.param.grad = _wrap(view, self._accumulating[position])
        count = self._accumulations[position] + 1
        if count > self._expected:
            raise RuntimeError(
                f"parameter {entry.name!r} received gradient accumulation {count} but the step declared "
                f"{self._expected} micro-batches; call begin_step(num_microbatches) with the step's micro-batch "
                "count, before its first backward."
            )
        self._accumulations[position] = count
        if count == self._expected:
            self._complete += 1

    def launch(self) -> None:
        if self.key.reduce_dims:  # a mesh of one replica has nothing to reduce
            group = self.key.mesh.get_group(self.key.reduce_dims[0])
            self._work = dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.launched = True

    def finish(self) -> None:
        if not self.launched:
            self.launch()
        if self._work is not None:
            self._work.wait()
            self._work = None
        for dim in self.key.reduce_dims[1:]:
            dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=self.key.mesh.get_group(dim))
        for entry, view, spec in zip(self.entries, self.views, self._reduced, strict=True):
            entry.param.grad = _wrap(view, spec)


def _spec(entry: ReplicatedParameter, view: torch.Tensor, placements: tuple[Placement, ...]) -> DTensorSpec:
    """What `DTensor.from_local(view, mesh, placements, shape=param.shape, stride=param.stride())` builds."""
    param = entry.param
    meta = TensorMeta(shape=param.shape, stride=param.stride(), dtype=view.dtype)
    return DTensorSpec(param.device_mesh, placements, tensor_meta=meta)


def _wrap(view: torch.Tensor, spec: DTensorSpec) -> DTensor:
    return DTensor(view, spec, requires_grad=False)  # type: ignore[no-untyped-call]  # DTensor.__new__ is untyped
