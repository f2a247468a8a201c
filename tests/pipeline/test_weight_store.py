"""The weight-gradient store split (design note 0024): `I` is one ordinary backward in which the attention and FFN
projections queue their weight gradients, `W` runs the queue. On real stages of the tiny Qwen3 dense and Qwen3-MoE
models, against one full backward of the same forward.

Tolerances. float32: `I` runs the same kernels as a full backward (input gradients and every non-deferred weight);
a deferred weight gradient is `grad^T @ x` where autograd's linear backward computes `(x^T @ grad)^T`, the same
products summed over the same rows by another matmul call, so rounding only: 1e-6 absolute on values of order 1e-1
(the observed difference is 0 or a few ulps). bfloat16: the same products rounded to bf16 once each, so the default
bf16 `assert_close` tolerance (rtol 1.6e-2, one bf16 ulp) on every gradient; accumulating into an existing gradient
is one `addmm_` rounding where autograd rounds the product then the sum, which that covers too.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_workload import EAGER, HIDDEN, SEQ, VOCAB, build_meta, load_initial
from torch import nn

from d9d.kernels.deferrable_linear import deferrable_linear
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.linear import DeferrableLinear
from d9d.models.blocks.moe import GroupedLinear, aux_loss_weights
from d9d.pipeline import (
    PipelineStage,
    WeightGradientStore,
    collecting_weight_gradients,
    deferring_weight_gradients,
    store_backward_input,
    store_backward_weight,
)

DEFERRED_NODE = "_DeferrableLinearBackward"


def _stage(
    family: str,
    index: int,
    count: int,
    decoder: DecoderConfig = EAGER,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
):
    module = materialize_(build_meta(family, PipelineStage(index, count), decoder), device)
    load_initial(module, family)
    weights = aux_loss_weights(module)
    if weights is not None:
        weights.set_weight(0.5)
    return module.to(dtype)


def _deferrable_weights(module: nn.Module) -> set[int]:
    """The projections' and the grouped experts' weights (eager grouped matmul: one of the backends with halves)."""
    return {id(m.weight) for m in module.modules() if isinstance(m, DeferrableLinear | GroupedLinear)}


def _graph_names(root: torch.Tensor) -> set[str]:
    names: set[str] = set()
    stack, seen = [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(child for child, _ in node.next_functions)
    return names


class _Run:
    """One forward of a stage on fixed data: (root, stage input or None, gradient seed or None)."""

    def __init__(
        self, module: nn.Module, index: int, count: int, dtype: torch.dtype, seed: int = 7, device: str = "cpu"
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.module, self.index, self.last = module, index, index == count - 1
        self.ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator).to(device)
        self.labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator).to(device)
        self.hidden = torch.randn(2, SEQ, HIDDEN, generator=generator).to(device, dtype)
        self.grad_out = torch.randn(2, SEQ, HIDDEN, generator=generator).to(device, dtype)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = None if self.index == 0 else self.hidden.clone().requires_grad_(True)
        ids, labels = self.ids if self.index == 0 else None, self.labels if self.last else None
        out = self.module(ids, hidden_states=x, labels=labels)
        if self.last:
            return out.loss_sum, x, None
        return out.hidden_states, x, self.grad_out


def _full(run: _Run) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    root, x, grad = run()
    torch.autograd.backward([root], [grad] if grad is not None else None)
    params = [p for p in run.module.parameters() if p.requires_grad]
    expected = [p.grad.clone() for p in params]
    expected_input = x.grad.clone() if x is not None else None
    run.module.zero_grad(set_to_none=True)
    return expected, expected_input


def _split(run: _Run) -> tuple[WeightGradientStore, torch.Tensor | None, torch.Tensor]:
    with deferring_weight_gradients():
        root, x, grad = run()
    grads, store = store_backward_input([root], [grad], [x] if x is not None else [])
    return store, grads[0] if grads else None, root


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_store_split_equals_full_backward(family, position):
    index, count = {"first": (0, 3), "middle": (1, 3), "last": (2, 3)}[position]
    module = _stage(family, index, count)
    run = _Run(module, index, count, torch.float32)
    expected, expected_input = _full(run)
    params = [p for p in module.parameters() if p.requires_grad]
    deferrable = _deferrable_weights(module)
    assert deferrable, "the stage has attention and FFN projections"

    store, input_grad, root = _split(run)
    assert len(store) == len(deferrable), "one queued work per projection and expert matmul"
    for param in params:  # I: every parameter but the projections' weights has its gradient
        assert (param.grad is None) == (id(param) in deferrable), tuple(param.shape)
    if expected_input is not None:
        torch.testing.assert_close(input_grad, expected_input, atol=1e-6, rtol=0)
    del root
    store_backward_weight(store)
    assert len(store) == 0
    for param, want in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_store_split_in_bfloat16(device):
    """On CUDA backward runs on autograd's device thread: the store is module state, not thread-local."""
    module = _stage("dense", 1, 3, dtype=torch.bfloat16, device=device)
    run = _Run(module, 1, 3, torch.bfloat16, device=device)
    expected, expected_input = _full(run)
    store, input_grad, _ = _split(run)
    assert len(store) == len(_deferrable_weights(module))
    store_backward_weight(store)
    torch.testing.assert_close(input_grad, expected_input)
    for param, want in zip([p for p in module.parameters() if p.requires_grad], expected, strict=True):
        assert param.grad.dtype == torch.bfloat16
        torch.testing.assert_close(param.grad, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_gradients_accumulate_into_existing_ones(dtype):
    """Two micro-batches through the store after a gradient already exists: the existing gradient plus both, as
    two full backwards accumulate (each W adds, none overwrites)."""
    module = _stage("moe", 1, 3, dtype=dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    first, second = _Run(module, 1, 3, dtype, seed=1), _Run(module, 1, 3, dtype, seed=2)
    start = [torch.full_like(p, 0.25) for p in params]
    for param, value in zip(params, start, strict=True):
        param.grad = value.clone()
    for run in (first, second):
        root, _, grad = run()
        torch.autograd.backward([root], [grad])
    expected = [p.grad.clone() for p in params]
    for param, value in zip(params, start, strict=True):
        param.grad = value.clone()
    stores = [_split(run)[0] for run in (first, second)]
    for store in reversed(stores):  # W in another order than I, as zero-bubble schedules run them
        store_backward_weight(store)
    # bf16: the partial sums (0.25 + products, up to ~1 here) are rounded in another order (W after W in reverse,
    # existing + product in one addmm_ rounding): two roundings of up to one bf16 ulp in [0.5, 1) (2^-8) each, 8e-3.
    tolerance = {"atol": 1e-6, "rtol": 0} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 1.6e-2}
    for param, want in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, want, **tolerance)


def test_weight_pass_runs_once_and_matmuls_only():
    module = _stage("dense", 1, 3)
    store, _, root = _split(_Run(module, 1, 3, torch.float32))
    del root
    counts: dict[str, int] = {}

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        store_backward_weight(store)
    matmuls = counts.pop("mm", 0) + counts.pop("addmm_", 0) + counts.pop("addmm", 0)
    assert matmuls == len(_deferrable_weights(module)), counts
    assert not any("backward" in name or "attention" in name for name in counts), counts
    with pytest.raises(RuntimeError, match="already ran"):
        store_backward_weight(store)
    with pytest.raises(RuntimeError, match="already ran"):
        store.defer(lambda: None)


def test_deferral_is_off_outside_a_pipeline_split():
    """Plain training records `F.linear` (no custom node) and gives bitwise the gradients of an `nn.Linear`; a
    marked forward whose backward is not collected (an ordinary backward) computes the weight gradient at once."""
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    deferrable = DeferrableLinear(16, 8)
    deferrable.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 16, requires_grad=True)
    grad = torch.randn(3, 5, 8)
    out_plain, out = plain(x), deferrable(x)
    assert torch.equal(out, out_plain)
    assert DEFERRED_NODE not in _graph_names(out)
    assert type(out.grad_fn).__name__ == type(out_plain.grad_fn).__name__
    out.backward(grad)
    x_grad = x.grad.clone()
    x.grad = None
    out_plain.backward(grad)
    assert torch.equal(x.grad, x_grad)
    assert torch.equal(deferrable.weight.grad, plain.weight.grad)
    assert torch.equal(deferrable.bias.grad, plain.bias.grad)

    deferrable.zero_grad(set_to_none=True)
    with deferring_weight_gradients():
        out = deferrable(x)
    assert DEFERRED_NODE in _graph_names(out)
    out.backward(grad)  # no store collecting: computed now
    torch.testing.assert_close(deferrable.weight.grad, plain.weight.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(deferrable.bias.grad, plain.bias.grad, atol=1e-6, rtol=0)


def test_parameters_with_gradient_hooks_are_left_to_autograd():
    """The gradient synchroniser counts accumulations with a post-accumulate hook: such weights are not deferred
    (computed in I, their hooks run by autograd), and a hook added after a deferring forward is refused in W."""
    layer = DeferrableLinear(8, 4, bias=False)
    calls: list[int] = []
    handle = layer.weight.register_post_accumulate_grad_hook(lambda param: calls.append(1))
    x = torch.randn(2, 8, requires_grad=True)
    with deferring_weight_gradients():
        out = layer(x)
    assert DEFERRED_NODE not in _graph_names(out)
    store = WeightGradientStore()
    with collecting_weight_gradients(store):
        out.sum().backward()
    assert len(store) == 0 and calls == [1] and layer.weight.grad is not None
    handle.remove()

    layer.weight.grad = None
    with deferring_weight_gradients():
        out = layer(x)
    with collecting_weight_gradients(store):
        out.sum().backward()
    layer.weight.register_post_accumulate_grad_hook(lambda param: None)
    with pytest.raises(RuntimeError, match="gradient hooks"):
        store.run()


def test_split_backward_choice_is_validated(monkeypatch):
    from d9d.pipeline.runtime.executor import resolve_split_backward

    monkeypatch.delenv("D9D_PIPELINE_SPLIT_BACKWARD", raising=False)
    assert resolve_split_backward() == "store"
    assert resolve_split_backward("graph") == "graph"
    monkeypatch.setenv("D9D_PIPELINE_SPLIT_BACKWARD", "graph")
    assert resolve_split_backward() == "graph"
    monkeypatch.setenv("D9D_PIPELINE_SPLIT_BACKWARD", "levels")
    with pytest.raises(ValueError, match=r"D9D_PIPELINE_SPLIT_BACKWARD='levels'.*valid: store, graph"):
        resolve_split_backward()
    with pytest.raises(ValueError, match="split_backward='walk'"):
        resolve_split_backward("walk")


def test_tensor_subclasses_and_frozen_weights_take_f_linear():
    weight = torch.randn(4, 8)  # frozen
    x = torch.randn(2, 8, requires_grad=True)
    with deferring_weight_gradients():
        assert DEFERRED_NODE not in _graph_names(deferrable_linear(x, weight))
        assert DEFERRED_NODE in _graph_names(deferrable_linear(x, weight.requires_grad_()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert DEFERRED_NODE not in _graph_names(deferrable_linear(x, weight))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_store_split_under_activation_checkpointing(policy):
    """A checkpointed layer recomputes its forward inside I: the recomputation must record the same deferrable
    nodes as the forward (the input pass keeps the forward marking on), or checkpointing's saved-tensor check fails."""
    from d9d.models.blocks.checkpointing import CheckpointPolicy, set_activation_checkpointing

    module = _stage("dense", 1, 3)
    for layer in module.modules():
        if type(layer).__name__.endswith("DecoderLayer"):
            set_activation_checkpointing(layer, CheckpointPolicy(policy))
    run = _Run(module, 1, 3, torch.float32)
    expected, expected_input = _full(run)
    store, input_grad, _ = _split(run)
    assert len(store) == len(_deferrable_weights(module))
    store_backward_weight(store)
    torch.testing.assert_close(input_grad, expected_input, atol=1e-6, rtol=0)
    for param, want in zip([p for p in module.parameters() if p.requires_grad], expected, strict=True):
        torch.testing.assert_close(param.grad, want, atol=1e-6, rtol=0)


def test_store_split_of_the_last_stage_with_loss_gradients_in_forward():
    """The fused loss that computes its gradients in forward reads the backward phase; the store's I runs in the
    full phase, so it keeps the head's weight gradient (nobody computes it later)."""
    decoder = EAGER.model_copy(update={"loss_gradients_in_forward": True})
    module = _stage("dense", 2, 3, decoder)
    run = _Run(module, 2, 3, torch.float32)
    expected, expected_input = _full(run)
    store, input_grad, _ = _split(run)
    store_backward_weight(store)
    torch.testing.assert_close(input_grad, expected_input, atol=1e-6, rtol=0)
    for param, want in zip([p for p in module.parameters() if p.requires_grad], expected, strict=True):
        torch.testing.assert_close(param.grad, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_split_defers_the_experts_of_each_grouped_matmul_backend(backend):
    """The grouped experts' halves per backend: `torch._grouped_mm` (a native kernel on CPU) and the Triton split
    ops (Triton's interpreter on CPU). float32; the Triton halves reduce in another order than the full backward's
    fused kernel, so 1e-5 as in test_split_backward.py; torch's are the products its own backward forms (1e-6)."""
    import importlib.util

    from d9d.kernels.grouped_mm import TorchGroupedMmConfig, TritonGroupedMmConfig

    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    config = TorchGroupedMmConfig() if backend == "torch" else TritonGroupedMmConfig()
    module = _stage("moe", 1, 3, EAGER.model_copy(update={"grouped_mm": config}))
    run = _Run(module, 1, 3, torch.float32)
    expected, expected_input = _full(run)
    store, input_grad, _ = _split(run)
    assert len(store) == len(_deferrable_weights(module))
    experts = [m.weight for m in module.modules() if isinstance(m, GroupedLinear)]
    assert experts and all(weight.grad is None for weight in experts)
    store_backward_weight(store)
    tolerance = 1e-6 if backend == "torch" else 1e-5
    torch.testing.assert_close(input_grad, expected_input, atol=tolerance, rtol=tolerance)
    for param, want in zip([p for p in module.parameters() if p.requires_grad], expected, strict=True):
        torch.testing.assert_close(param.grad, want, atol=tolerance, rtol=tolerance)
