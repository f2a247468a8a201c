"""Where a kernel's backward may leave its weight gradients for later: the pipeline's weight-gradient store.

A pipeline schedule that splits backward (zero bubble) wants the input gradients of a stage now (`I`, on the
critical path: the previous stage waits for them) and the weight gradients later (`W`, filling a bubble). A kernel
whose backward computes both by hand can serve that directly: during `I` it computes its input gradient and hands
its weight-gradient work (a closure over the saved input, the incoming gradient and the parameter) to the sink;
`W` runs the queued work. The pipeline package owns the store, but kernels never import it: whoever wires the two
together registers a `WeightGradientSink` (d9d-models does, from `d9d.pipeline`'s store). Without one nothing is
deferred.

Two questions, asked at two times:

- `deferring()`, in forward: will the backward of what is being computed now be split? A kernel then records the
  node that can defer (a custom autograd function); otherwise it keeps its ordinary, faster path.
- `defer(work)`, in backward: is a store collecting now? If so it queues `work` and returns True, and the kernel
  returns no weight gradient; if not (an ordinary backward of that forward) the kernel computes it now.

Both are plain module state, not context variables: CUDA backward runs on autograd's device threads.
`accumulate_weight_gradient` adds a gradient into `param.grad` the way autograd's `AccumulateGrad` does, for the
queued work to use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

WeightGradientWork = Callable[[], None]  # computes a weight gradient and accumulates it into the parameter's .grad


class WeightGradientSink(Protocol):
    def deferring(self) -> bool:
        """Forward: the backward of what is being computed now may defer its weight gradients."""
        ...

    def defer(self, work: WeightGradientWork) -> bool:
        """Backward: queue `work` for later and return True, or return False (compute it now) when not collecting."""
        ...


_sinks: list[WeightGradientSink] = []


def register_weight_gradient_sink(sink: WeightGradientSink) -> None:
    """Make `sink` the one kernels ask (replacing any registered before)."""
    _sinks[:] = [sink]


def weight_gradients_deferring() -> bool:
    """Forward: whether a kernel should record its deferrable node (a registered sink says so)."""
    return bool(_sinks) and _sinks[0].deferring()


def defer_weight_gradient(work: WeightGradientWork) -> bool:
    """Backward: queue `work` in the collecting store (True) or leave it to the caller (False)."""
    return bool(_sinks) and _sinks[0].defer(work)


def has_gradient_hooks(param: torch.Tensor) -> bool:
    """Hooks autograd's accumulator would run around `param`'s accumulation (tensor hooks, post-accumulate hooks,
    e.g. the gradient synchroniser's); deferring kernels leave such parameters to autograd."""
    return bool(param._backward_hooks) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def may_defer(weight: torch.Tensor, *operands: torch.Tensor | None) -> bool:
    """Forward: whether a kernel may record its deferrable node for `weight` (see `deferrable_linear`'s module doc):
    a sink is deferring, gradients are recorded for a trainable weight, every operand is a plain tensor (no DTensor
    or other subclass), no `torch.compile` tracing, no autocast, and the weight has no gradient hooks."""
    if not (weight.requires_grad and torch.is_grad_enabled()) or not weight_gradients_deferring():
        return False
    if type(weight) not in _PLAIN or any(t is not None and type(t) not in _PLAIN for t in operands):
        return False
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(weight.device.type):
        return False
    return not has_gradient_hooks(weight)


def gradient_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype autograd keeps `param.grad` in (`Tensor.grad_dtype` where set, else the parameter's)."""
    dtype = getattr(param, "grad_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else param.dtype


def accumulate_weight_gradient(param: torch.Tensor, grad: torch.Tensor) -> None:
    """`param.grad += grad`, or `param.grad = grad` when there is none, as `AccumulateGrad` does: cast to the
    gradient dtype, stolen when fresh (`grad` must be a tensor nobody else holds, as a matmul's result is), added in
    place otherwise (so FSDP's unsharded gradients and any optimizer reference stay the same tensor).

    Raises:
        RuntimeError: `param` gained gradient hooks after its forward (they would run at another time than autograd
            runs them, or twice for a weight used twice).
    """
    if has_gradient_hooks(param):
        raise RuntimeError(
            f"a deferred weight gradient for a parameter of shape {tuple(param.shape)} with gradient hooks: hooks "
            "registered after the forward that deferred it; register them before (the parameter then is computed "
            "in the input pass) or run this backward unsplit"
        )
    grad = grad.to(gradient_dtype(param))
    with torch.no_grad():
        if param.grad is None:
            # Stolen when it has the parameter's layout (AccumulateGrad's layout contract), else copied into it.
            param.grad = (
                grad if grad.stride() == param.stride() else torch.empty_like(param, dtype=grad.dtype).copy_(grad)
            )
        else:
            param.grad.add_(grad)
