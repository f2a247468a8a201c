"""Split backward through a weight-gradient store: `I` is one ordinary backward, `W` runs the queued matmuls.

Design note 0024. The executor marks the forwards whose backward it will split (`deferring_weight_gradients`); there
the deferrable ops (d9d-kernels' `deferrable_linear`: the attention and FFN projections of d9d-models) record a
custom node instead of `F.linear`. `store_backward_input` opens a `WeightGradientStore` for the (stage, micro-batch)
and runs one `torch.autograd.backward` from the stage outputs, no graph walk and no hook: each deferrable node
computes its input gradient and queues its weight-gradient work (its saved input, the incoming gradient and the
parameter) in the store, as do the MoE grouped experts (d9d-kernels' `deferrable_grouped_mm`); every other parameter
(norm weights, embeddings, experts under expert parallelism, the fused loss's head, anything under tensor
parallelism) gets its gradient from autograd in this pass, as in a full backward. `store_backward_weight` later runs
the queue once: one matmul per deferred weight, accumulated into `.grad` as autograd's accumulator would (in place
into an existing gradient, through `addmm_`).

The store answers d9d-kernels' `WeightGradientSink` protocol (`PIPELINE_WEIGHT_GRADIENT_SINK`, which d9d-models
registers; this package does not import the kernels). Its state is plain module state, not a context variable:
CUDA backward runs on autograd's device threads. The input pass keeps the forward marking on, so a checkpointed
layer's recomputation inside it records the same nodes as its forward did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

WeightGradientWork = Callable[[], None]


class WeightGradientStore:
    """The deferred weight-gradient work of one (stage, micro-batch): filled by `I`, run exactly once by `W`."""

    def __init__(self) -> None:
        self._work: list[WeightGradientWork] = []
        self.ran = False

    def __len__(self) -> int:
        return len(self._work)

    def defer(self, work: WeightGradientWork) -> None:
        if self.ran:
            raise RuntimeError("weight-gradient work queued into a store whose weight pass already ran")
        self._work.append(work)

    def run(self) -> int:
        """Run the queued work (outside autograd: plain matmuls into `.grad`), release what it holds, return how
        many items ran."""
        if self.ran:
            raise RuntimeError("the weight pass of this store already ran: each W runs once per micro-batch")
        self.ran = True
        work, self._work = self._work, []
        with torch.no_grad():
            for item in work:
                item()
        return len(work)


_collecting: WeightGradientStore | None = None
_deferring = False


@contextmanager
def deferring_weight_gradients(enabled: bool = True) -> Iterator[None]:
    """Around a forward whose backward will be split: deferrable ops record their deferrable node."""
    global _deferring  # noqa: PLW0603 - module state, see the module docstring
    previous, _deferring = _deferring, enabled
    try:
        yield
    finally:
        _deferring = previous


@contextmanager
def collecting_weight_gradients(store: WeightGradientStore) -> Iterator[WeightGradientStore]:
    """Around an input pass: deferrable nodes queue their weight gradients in `store`."""
    global _collecting  # noqa: PLW0603 - module state, see the module docstring
    previous, _collecting = _collecting, store
    try:
        with deferring_weight_gradients():
            yield store
    finally:
        _collecting = previous


class _PipelineWeightGradientSink:
    """d9d-kernels' `WeightGradientSink` over this module's state."""

    def deferring(self) -> bool:
        return _deferring

    def defer(self, work: WeightGradientWork) -> bool:
        store = _collecting
        if store is None:
            return False
        store.defer(work)
        return True


PIPELINE_WEIGHT_GRADIENT_SINK = _PipelineWeightGradientSink()


def store_backward_input(
    outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor | None], WeightGradientStore]:
    """Gradients of `inputs` (None where not reached) and the store `store_backward_weight` runs.

    One ordinary backward (the graph is freed after it); every parameter not deferred accumulates its gradient now.
    `inputs` must be leaves (the executor's received activations), whose `.grad` this sets.
    """
    for tensor in inputs:
        if not tensor.is_leaf:
            raise ValueError(f"the stage inputs of a store split must be leaves, got one with {tensor.grad_fn}")
    seeds = [
        grad if grad is not None else torch.ones_like(out) for out, grad in zip(outputs, grad_outputs, strict=True)
    ]
    store = WeightGradientStore()
    with collecting_weight_gradients(store):
        torch.autograd.backward(list(outputs), seeds)
    return [tensor.grad for tensor in inputs], store


def store_backward_weight(store: WeightGradientStore) -> int:
    """Accumulate the deferred weight gradients (the second half of `store_backward_input`); how many ran."""
    return store.run()
