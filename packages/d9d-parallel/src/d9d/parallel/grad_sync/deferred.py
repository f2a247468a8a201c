"""A gradient synchroniser for a module built on the meta device: its buckets are made at the first step.

The synchroniser's buckets hold the gradients in flat buffers beside the parameters. A module parallelised on the
meta device (the normal life cycle: build on meta, parallelise, materialise) has no storage yet, so buckets made
then would stay on the meta device. This defers building them, and collecting the parameters (materialisation may
replace them), to the first `begin_step`.
"""

from __future__ import annotations

import torch
from torch import nn

from d9d.parallel.grad_sync.synchronizer import DEFAULT_BUCKET_SIZE_MB, GradientSynchronizer


class DeferredGradientSynchronizer:
    """`GradientSynchronizer.for_module(module, ...)`, built at the first `begin_step` instead of now."""

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self._module = module
        self._bucket_size_mb = bucket_size_mb
        self._grad_dtype = grad_dtype
        self._synchronizer: GradientSynchronizer | None = None

    @property
    def synchronizer(self) -> GradientSynchronizer | None:
        """The real synchroniser once the first step has begun, else `None`."""
        return self._synchronizer

    def begin_step(self, num_microbatches: int) -> None:
        if self._synchronizer is None:
            on_meta = [name for name, param in self._module.named_parameters() if param.is_meta]
            if on_meta:
                raise RuntimeError(
                    f"{len(on_meta)} parameters (first: {on_meta[0]!r}) are still on the meta device at the first "
                    "training step; materialise the module (e.g. `to_empty` and `reset_parameters`) before it."
                )
            self._synchronizer = GradientSynchronizer.for_module(
                self._module, bucket_size_mb=self._bucket_size_mb, grad_dtype=self._grad_dtype
            )
        self._synchronizer.begin_step(num_microbatches)

    def wait(self) -> None:
        if self._synchronizer is None:
            raise RuntimeError("wait() without begin_step(num_microbatches): no step is accumulating gradients")
        self._synchronizer.wait()
