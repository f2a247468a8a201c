"""Split backward (input gradients now, weight gradients later) equals one full backward, on real stages of the tiny
Qwen3 dense and Qwen3-MoE models: the chunked linear-cross-entropy loss (a custom autograd.Function), the MoE
router's auxiliary losses (attached with another custom Function), grouped expert matmuls. The input pass must not
touch any parameter's gradient. Bitwise equality is expected and asserted with a 1e-6 slack: the two passes run the
same kernels on the same tensors; only the parameter gradients that gather contributions from several paths (the
split pass adds the W-pass result into `.grad` once) may round differently. The chunked loss reads the backward
phase and skips the unused half in each pass; "whole" (first and last stage at once, where the weight pass is the
entire backward) pins that it must not skip anything there."""

import collections
import importlib.util

import pytest
import torch
from pipeline_workload import EAGER, HIDDEN, SEQ, VOCAB, build_meta, load_initial
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.kernels.grouped_mm import TritonGroupedMmConfig
from d9d.kernels.linear_cross_entropy import TritonLinearCrossEntropyConfig
from d9d.kernels.moe_permute import TritonMoePermuteConfig
from d9d.kernels.rms_norm import TritonRmsNormConfig
from d9d.kernels.rope import TritonRopeConfig
from d9d.kernels.swiglu import TritonSwiGluConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.moe import aux_loss_weights
from d9d.pipeline import PipelineStage, backward_input, backward_weight


def _stage(family: str, index: int, count: int, decoder: DecoderConfig = EAGER):
    module = materialize_(build_meta(family, PipelineStage(index, count), decoder), "cpu")
    load_initial(module, family)
    weights = aux_loss_weights(module)
    if weights is not None:
        weights.set_weight(0.5)
    return module


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("position", ["first", "middle", "last", "whole"])
def test_split_backward_equals_full_backward(family, position):
    index, count = {"first": (0, 3), "middle": (1, 3), "last": (2, 3), "whole": (0, 1)}[position]
    is_last = index == count - 1
    module = _stage(family, index, count)
    params = [param for param in module.parameters() if param.requires_grad]
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    hidden = torch.randn(2, SEQ, HIDDEN, generator=generator)
    grad_out = torch.randn(2, SEQ, HIDDEN, generator=generator)

    def run() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = None if index == 0 else hidden.clone().requires_grad_(True)
        out = module(ids if index == 0 else None, hidden_states=x, labels=labels if is_last else None)
        root = out.losses.sum() if is_last else out.hidden_states
        return root, x, None if is_last else grad_out

    root, x, grad = run()
    torch.autograd.backward([root], [grad] if grad is not None else None)
    expected = [param.grad.clone() for param in params]
    expected_input = x.grad.clone() if x is not None else None
    module.zero_grad(set_to_none=True)

    root, x, grad = run()
    grads, work = backward_input([root], [grad], [x] if x is not None else [], params)
    assert all(param.grad is None for param in params), "the input pass wrote a weight gradient"
    if x is not None:
        assert torch.allclose(grads[0], expected_input, atol=1e-6, rtol=0)
    backward_weight(work, params)
    for param, want in zip(params, expected, strict=True):
        assert param.grad is not None
        assert torch.allclose(param.grad, want, atol=1e-6, rtol=0)


class _ScaledMatmul(torch.autograd.Function):
    """A custom autograd function taking an activation and a weight (like the Triton kernels' and flash attention's
    wrappers): its backward node is an intermediate of the split, and autograd keeps such a node alive only while
    something holds the graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return 2.0 * (x @ weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        return 2.0 * grad @ weight.T, 2.0 * x.transpose(-1, -2) @ grad


def test_split_backward_through_a_custom_function_after_the_outputs_are_dropped():
    """The executor drops a stage's outputs once `I` has run; `W` must still reach the custom node. Under torch 2.11
    (the GPU image's) a custom node's Python object holds its C++ node only weakly, so without
    `WeightGradientWork.graph_owners` this failed there with "Attribute 'register_prehook' is invalid for this
    instance of _C._FunctionBase" (ZBV and DualPipeV on CUDA, docs/benchmarks.md); torch 2.13 (this machine's) owns
    the node from the Python object, so here it passes either way."""
    torch.manual_seed(0)
    weight_in = torch.randn(8, 8, requires_grad=True)
    weight_custom = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return _ScaledMatmul.apply(torch.tanh(inp @ weight_in), weight_custom).sum(dim=-1)

    reference = forward(x)
    grad_out = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, [x, weight_in, weight_custom], grad_out)

    stage_input = x.detach().requires_grad_(True)
    output = forward(stage_input)
    (input_grad,), work = backward_input([output], [grad_out], [stage_input], [weight_in, weight_custom])
    del output  # as the executor does: only `work` holds the graph until `W`
    backward_weight(work, [weight_in, weight_custom])
    assert torch.allclose(input_grad, expected[0], atol=1e-6)  # fp32, same ops in another order: rounding only
    assert torch.allclose(weight_in.grad, expected[1], atol=1e-6)
    assert torch.allclose(weight_custom.grad, expected[2], atol=1e-6)


TRITON = EAGER.model_copy(
    update={
        "rms_norm": TritonRmsNormConfig(),
        "swiglu": TritonSwiGluConfig(),
        "rope": TritonRopeConfig(),
        "moe_permute": TritonMoePermuteConfig(),
        "linear_cross_entropy": TritonLinearCrossEntropyConfig(),
        "grouped_mm": TritonGroupedMmConfig(),
    }
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("position", ["middle", "last"])
def test_split_backward_through_the_triton_kernels_after_the_outputs_are_dropped(position):
    """The node types of the CUDA failure, on CPU in Triton's interpreter: every Triton kernel of a MoE stage (RMSNorm,
    RoPE, permute, grouped matmul; the linear cross-entropy on the last stage) is a custom op whose autograd is a
    custom `autograd.Function`, so such nodes sit between the stage input and the weights. The outputs are dropped
    between `I` and `W` as the executor does. float32: the kernels' input and weight halves reduce in another order
    than their full backward (a few ulps), so 1e-5."""
    index = {"middle": 1, "last": 2}[position]
    module = _stage("moe", index, 3, TRITON)
    params = [param for param in module.parameters() if param.requires_grad]
    generator = torch.Generator().manual_seed(7)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    hidden = torch.randn(2, SEQ, HIDDEN, generator=generator)
    grad_out = torch.randn(2, SEQ, HIDDEN, generator=generator)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = hidden.clone().requires_grad_(True)
        out = module(None, hidden_states=x, labels=labels if position == "last" else None)
        return (out.losses.sum(), x, None) if position == "last" else (out.hidden_states, x, grad_out)

    root, x, grad = run()
    torch.autograd.backward([root], [grad] if grad is not None else None)
    expected = [param.grad.clone() for param in params]
    expected_input = x.grad.clone()
    module.zero_grad(set_to_none=True)

    root, x, grad = run()
    (input_grad,), work = backward_input([root], [grad], [x], params)
    del root  # as the executor does: only `work` holds the graph until `W`
    backward_weight(work, params)
    torch.testing.assert_close(input_grad, expected_input, atol=1e-5, rtol=1e-5)
    for param, want in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, want, atol=1e-5, rtol=1e-5)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops autograd runs (by overload packet name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_weight_pass_runs_only_the_weight_halves():
    """The weight pass of a middle dense stage must not redo the input half: exactly one matmul per linear weight
    (grad_W = grad_out^T x), no attention or activation backward. Until the weight pass was split into levels it
    ran every op of a full backward again (the input chain to reach the earlier layers' weights): 2 layers ran 30
    matmuls and 2 attention backwards instead of 14 and none. The op counts are exact, not timings."""
    module = _stage("dense", 1, 3)
    params = [param for param in module.parameters() if param.requires_grad]
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, SEQ, HIDDEN, generator=generator).requires_grad_(True)
    out = module(None, hidden_states=x).hidden_states
    (input_grad,), work = backward_input([out], [torch.randn(out.shape, generator=generator)], [x], params)
    del out
    assert input_grad is not None
    with _OpCounter() as weight_ops:
        backward_weight(work, params)
    matmuls = weight_ops.counts["mm"] + weight_ops.counts["bmm"] + weight_ops.counts["addmm"]
    assert matmuls == len(linears), dict(weight_ops.counts)
    backwards = [name for name in weight_ops.counts if "attention" in name or name.endswith("_backward")]
    assert not backwards, dict(weight_ops.counts)
    assert all(param.grad is not None for param in params)


def test_split_backward_with_a_weight_used_at_two_levels():
    """One weight in two layers (as tied or shared weights are): its gradient gathers a share from two levels of
    the weight pass, each exactly once. fp32, the same ops in another order: rounding only, so 1e-6."""
    torch.manual_seed(0)
    shared = torch.randn(8, 8, requires_grad=True)
    other = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def forward(inp: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(torch.tanh(inp @ shared) @ other) @ shared)

    reference = forward(x)
    grad_out = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, [x, shared, other], grad_out)
    stage_input = x.detach().requires_grad_(True)
    output = forward(stage_input)
    (input_grad,), work = backward_input([output], [grad_out], [stage_input], [shared, other])
    assert work.shared and work.num_calls == 3
    del output
    backward_weight(work, [shared, other])
    assert torch.allclose(input_grad, expected[0], atol=1e-6)
    assert torch.allclose(shared.grad, expected[1], atol=1e-6)
    assert torch.allclose(other.grad, expected[2], atol=1e-6)
