"""Bucketed, overlapped gradient all-reduce for replicated parameters: d9d's replacement for DDP."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from d9d.parallel.grad_sync.bucket import BucketKey, GradientBucket
from d9d.parallel.replicate.marker import ReplicatedParameter, replicated_parameters

DEFAULT_BUCKET_SIZE_MB = 25.0


class GradientSynchronizer:
    """All-reduces (sums) the gradients of replicated parameters, overlapping communication with backward.

    Parameters are grouped into buckets by mesh, reduce dimensions, device and gradient dtype, walking them in
    reverse order of registration (roughly the order backward produces their gradients) and closing a bucket at
    `bucket_size_mb`. A post-accumulate-grad hook counts each parameter's accumulations; when every parameter of a
    bucket has accumulated the step's last micro-batch, the bucket's asynchronous all-reduce is launched. Buckets
    launch strictly in bucket order, so every rank issues the same collectives in the same order even when its
    backward finishes buckets in another order. `wait()` launches whatever has not launched (a parameter unused in
    some micro-batch simply contributes nothing) and waits for all of it.

    The reduction is a sum: divide the loss by the global number of tokens (or samples) of the step, as FSDP with
    sum reduction expects too, and the synchronised gradient is the gradient of the global mean.

    Use per step: `begin_step(n)`, then `n` backward passes, then `wait()` before clipping and the optimizer step.

    Args:
        parameters: replicated parameters (`replicated_parameters(module)`, which `for_module` uses).
        bucket_size_mb: target bucket size in MiB of gradient.
        grad_dtype: dtype to accumulate and reduce gradients in (e.g. torch.float32 for bfloat16 parameters);
            `None` uses each parameter's mixed-precision reduce dtype, else its own dtype. A gradient dtype
            other than the parameter's is set as the parameter's `grad_dtype`, so optimizers see that dtype.
    """

    def __init__(
        self,
        parameters: Iterable[ReplicatedParameter],
        *,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self.buckets = _make_buckets(_unique(parameters), int(bucket_size_mb * 2**20), grad_dtype)
        self._where: dict[int, tuple[GradientBucket, int]] = {}
        self._hooks: list[RemovableHandle] = []
        for bucket in self.buckets:
            for position, entry in enumerate(bucket.entries):
                self._where[id(entry.param)] = (bucket, position)
                _set_grad_dtype(entry.param, bucket.key.dtype)
                hook = entry.param.register_post_accumulate_grad_hook(self._on_accumulated)  # type: ignore[no-untyped-call]  # untyped in torch
                self._hooks.append(hook)
        self._next_launch = 0
        self._active = False

    @classmethod
    def for_module(
        cls, module: nn.Module, *, bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB, grad_dtype: torch.dtype | None = None
    ) -> GradientSynchronizer:
        """A synchroniser over every trainable parameter `parallelize_replicate` distributed in `module`.

        Raises:
            ValueError: `module` has none (it was not replicated, or FSDP owns its parameters).
        """
        parameters = replicated_parameters(module)
        if not parameters:
            raise ValueError(
                f"{type(module).__name__} has no trainable parameters distributed by parallelize_replicate; "
                "replicate it first (FSDP and HSDP reduce their own gradients and need no synchroniser)."
            )
        return cls(parameters, bucket_size_mb=bucket_size_mb, grad_dtype=grad_dtype)

    def begin_step(self, num_microbatches: int) -> None:
        """Zero every gradient and expect `num_microbatches` backward passes before `wait()`."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        for bucket in self.buckets:
            bucket.reset(num_microbatches)
        self._next_launch = 0
        self._active = True

    def wait(self) -> None:
        """Finish the step's reductions; afterwards every gradient is the `Replicate` sum over all replicas."""
        if not self._active:
            raise RuntimeError("wait() without begin_step(num_microbatches): no step is accumulating gradients")
        self._launch_ready(flush=True)
        for bucket in self.buckets:
            bucket.finish()
        self._active = False

    def remove(self) -> None:
        """Unregister the hooks and restore each parameter's gradient dtype; gradients are cleared."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for bucket in self.buckets:
            for entry in bucket.entries:
                entry.param.grad = None
                _set_grad_dtype(entry.param, entry.param.dtype)
        self.buckets = []
        self._where.clear()

    def _on_accumulated(self, param: torch.Tensor) -> None:
        bucket, position = self._where[id(param)]
        if not self._active:
            raise RuntimeError(
                f"a gradient of {bucket.entries[position].name!r} was accumulated outside a step: call "
                "GradientSynchronizer.begin_step(num_microbatches) before the step's first backward (and wait() "
                "after its last)."
            )
        bucket.accumulated(position)
        if bucket.ready:
            self._launch_ready(flush=False)

    def _launch_ready(self, *, flush: bool) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not (flush or bucket.ready):
                return
            bucket.launch()
            self._next_launch += 1


def _unique(parameters: Iterable[ReplicatedParameter]) -> list[ReplicatedParameter]:
    seen: set[int] = set()
    unique: list[ReplicatedParameter] = []
    for record in parameters:
        if not record.param.requires_grad:
            raise ValueError(f"{record.name!r} does not require a gradient; pass only trainable parameters")
        if id(record.param) not in seen:
            seen.add(id(record.param))
            unique.append(record)
    return unique


def _make_buckets(
    entries: list[ReplicatedParameter], capacity: int, grad_dtype: torch.dtype | None
) -> list[GradientBucket]:
    """Fill buckets walking parameters in reverse; order buckets by when their first gradient is expected."""
    open_buckets: dict[BucketKey, list[ReplicatedParameter]] = {}
    open_bytes: dict[BucketKey, int] = {}
    closed: list[tuple[BucketKey, list[ReplicatedParameter]]] = []
    for entry in reversed(entries):
        param = entry.param
        local = param.to_local()
        dtype = grad_dtype or entry.info.reduce_dtype or param.dtype
        key = BucketKey(mesh=param.device_mesh, reduce_dims=entry.info.reduce_dims, device=local.device, dtype=dtype)
        nbytes = local.numel() * dtype.itemsize
        if key in open_buckets and open_bytes[key] + nbytes > capacity:
            closed.append((key, open_buckets.pop(key)))
            del open_bytes[key]
        open_buckets.setdefault(key, []).append(entry)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes
    closed.extend(open_buckets.items())
    order = {id(entry.param): index for index, entry in enumerate(reversed(entries))}
    closed.sort(key=lambda item: order[id(item[1][0].param)])
    return [GradientBucket(key, bucket_entries) for key, bucket_entries in closed]


def _set_grad_dtype(param: torch.Tensor, dtype: torch.dtype) -> None:
    if getattr(param, "grad_dtype", param.dtype) == dtype:
        return
    if not hasattr(torch.Tensor, "grad_dtype"):
        raise RuntimeError(
            f"a gradient dtype ({dtype}) other than the parameter's ({param.dtype}) needs Tensor.grad_dtype, "
            f"which torch {torch.__version__} lacks"
        )
    param.grad = None
    param.grad_dtype = dtype
