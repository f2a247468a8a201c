"""One data-parallel rank without FSDP: the module's own parameters in the compute dtype, gradients in the reduce dtype.

On one rank FSDP's all-gathers and reduce-scatters are copies, and its hooks cost host time on every unit; this style
does none of that. Mixed precision keeps its meaning with no master copy: parameters are *stored* in
`param_dtype` (cast in place; buffers such as RoPE tables keep their dtype) and autograd accumulates their
gradients in `reduce_dtype` (`Tensor.grad_dtype`), which is what FSDP hands the optimizer after a float32
reduction. Train bfloat16 parameters with `StochasticAdamW` (d9d.core.optim): plain AdamW would round every small
update away.
"""

from __future__ import annotations

import torch
from torch import nn

from d9d.parallel.mixed_precision import MixedPrecision


def cast_parameters_(module: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating parameter of `module` in `dtype`, in place (same `Parameter` objects, so tied weights
    stay tied and a meta-device module stays on meta)."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


class SingleDeviceGradientSync:
    """The loop's per-step protocol for an unwrapped module: gradients start at None, accumulate in `grad_dtype`.

    The module's parameters are collected at the first `begin_step` (after materialisation: moving a
    module off the meta device makes new `Parameter` objects) and their `grad_dtype` is set then, once. Later storage
    moves (`.data` assignment, `to()`, checkpoint loading) keep both the objects and `grad_dtype`, so each step only
    clears the gradients of that list: no walk over the module tree, which costs milliseconds of host time at the
    anchors' 311 parameters.
    """

    def __init__(self, module: nn.Module, *, grad_dtype: torch.dtype | None) -> None:
        self.module = module
        self.grad_dtype = grad_dtype
        self._parameters: list[nn.Parameter] | None = None

    def begin_step(self, num_microbatches: int) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        if self._parameters is None:
            self._parameters = self._collect()
        for param in self._parameters:
            param.grad = None

    def wait(self) -> None:
        """Nothing to reduce: the gradients are complete when backward returns."""

    def _collect(self) -> list[nn.Parameter]:
        named = list(self.module.named_parameters())
        on_meta = [name for name, param in named if param.is_meta]
        if on_meta:  # materialising would make new `Parameter` objects, without the `grad_dtype` set here
            raise RuntimeError(
                f"{len(on_meta)} parameters (first: {on_meta[0]!r}) are still on the meta device at the first "
                "training step; materialise the module (e.g. `materialize_`) before it."
            )
        parameters = [param for _, param in named]
        if self.grad_dtype is not None:
            for param in parameters:
                if param.requires_grad and param.is_floating_point() and param.grad_dtype != self.grad_dtype:
                    param.grad_dtype = self.grad_dtype
        return parameters


def parallelize_single_device(
    module: nn.Module, *, mixed_precision: MixedPrecision | None = None
) -> SingleDeviceGradientSync:
    """Prepare `module` for training on one data-parallel rank (see the module doc); returns its gradient sync."""
    policy = mixed_precision or MixedPrecision()
    if policy.param_dtype is not None:
        cast_parameters_(module, policy.param_dtype)
    return SingleDeviceGradientSync(module, grad_dtype=policy.reduce_dtype)
