"""The fused loss kernels compute only the half of backward a pipeline's split-backward pass uses."""

import importlib.util

import pytest
import torch

from d9d.kernels.linear_cross_entropy import EagerLinearCrossEntropy, TritonLinearCrossEntropy
from d9d.models.blocks import kernels as _registers_the_phase_provider  # noqa: F401 - import registers the provider
from d9d.pipeline import BackwardPhase, backward_phase

BACKENDS = [EagerLinearCrossEntropy]
if importlib.util.find_spec("triton") is not None:
    BACKENDS.append(TritonLinearCrossEntropy)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_input_and_weight_passes_compute_their_half_and_match_the_full_backward(backend):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 40, (10,), generator=generator)
    loss_fn = backend()
    full = torch.autograd.grad(loss_fn(hidden, weight, labels, chunk_size=4).sum(), [hidden, weight])
    with backward_phase(BackwardPhase.INPUT):
        (grad_hidden,) = torch.autograd.grad(loss_fn(hidden, weight, labels, chunk_size=4).sum(), [hidden])
    with backward_phase(BackwardPhase.WEIGHT):
        (grad_weight,) = torch.autograd.grad(loss_fn(hidden, weight, labels, chunk_size=4).sum(), [weight])
    torch.testing.assert_close(grad_hidden, full[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_weight, full[1], atol=1e-6, rtol=1e-6)
    with backward_phase(BackwardPhase.INPUT):  # the weight half is skipped: nothing reaches the weight
        grads = torch.autograd.grad(
            loss_fn(hidden, weight, labels, chunk_size=4).sum(), [hidden, weight], allow_unused=True
        )
    assert grads[1] is None


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_summed_loss_passes_return_their_half_of_the_gradients_computed_in_forward(backend):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 40, (10,), generator=generator)
    loss_fn = backend()

    def total():
        return loss_fn.summed(hidden, weight, labels, chunk_size=4).total * 0.25

    full = torch.autograd.grad(total(), [hidden, weight])
    # One forward, two passes over the same graph, as a zero-bubble schedule runs them.
    loss = total()
    with backward_phase(BackwardPhase.INPUT):
        grad_hidden, unused = torch.autograd.grad(loss, [hidden, weight], retain_graph=True, allow_unused=True)
    with backward_phase(BackwardPhase.WEIGHT):
        unused_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight], allow_unused=True)
    assert unused is None and unused_hidden is None
    torch.testing.assert_close(grad_hidden, full[0], atol=0, rtol=0)  # the same saved gradient, the same scaling
    torch.testing.assert_close(grad_weight, full[1], atol=0, rtol=0)
