"""`kernel_op`: plain eager calls run the body directly, everything that must see the custom op still does, and both
paths give bit-identical results."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_cases import randn, requires_triton

from d9d.kernels.triton_support import KernelOp, kernel_op, kernel_op_calls, set_kernel_op_calls


@kernel_op("d9d_kernel_op_test::scaled")
def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scaled.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    del factor
    return torch.empty_like(x)


class _OpCalls:
    """Counts the calls that went through the custom op (the dispatcher) rather than the direct body."""

    def __init__(self, kernel: KernelOp, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        op = kernel.op

        def counting(*args, **kwargs):
            self.count += 1
            return op(*args, **kwargs)

        monkeypatch.setattr(kernel, "op", counting)


class _SeenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _direct_calls():
    previous = kernel_op_calls()
    set_kernel_op_calls("direct")
    yield
    set_kernel_op_calls(previous)


def test_eager_call_without_gradient_recording_runs_the_body_directly(monkeypatch):
    calls = _OpCalls(_scaled, monkeypatch)
    x = torch.arange(4.0)
    with torch.no_grad():
        got = _scaled(x, 2.0)
    torch.testing.assert_close(got, x * 2, rtol=0, atol=0)
    assert calls.count == 0


def test_calls_that_something_could_observe_go_through_the_op(monkeypatch):
    calls = _OpCalls(_scaled, monkeypatch)
    x = torch.arange(4.0)
    _scaled(x, 2.0)  # gradient recording on: the op runs its body below autograd
    with torch.no_grad():
        with _SeenOps() as seen:  # a dispatch mode (selective checkpointing, FakeTensorMode, op counters)
            _scaled(x, 2.0)
        assert any("d9d_kernel_op_test.scaled" in name for name in seen.names), seen.names
        meta = _scaled(torch.empty(4, device="meta"), 2.0)  # a meta tensor: the fake runs
        assert meta.is_meta
        set_kernel_op_calls("dispatch")
        _scaled(x, 2.0)
    assert calls.count == 4


def test_compiled_graph_keeps_the_op():
    seen: list[str] = []

    def backend(graph, example_inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes)
        return graph

    @torch.compile(backend=backend, fullgraph=True)
    def run(x):
        with torch.no_grad():
            return _scaled(x, 3.0)

    torch._dynamo.reset()
    torch.testing.assert_close(run(torch.arange(4.0)), torch.arange(4.0) * 3, rtol=0, atol=0)
    assert any("d9d_kernel_op_test.scaled" in name for name in seen), seen


def test_profiled_call_takes_the_same_direct_path(monkeypatch):
    # A profiled step must run what an unprofiled one runs: the pipeline benchmark measures its bubble on one.
    calls = _OpCalls(_scaled, monkeypatch)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _scaled(torch.arange(4.0), 2.0)
    assert calls.count == 0


def test_unknown_call_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"mode='fast' is not a kernel-op call mode; valid: direct, dispatch"):
        set_kernel_op_calls("fast")  # type: ignore[arg-type]


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_direct_and_dispatched_triton_kernels_are_bit_identical(dtype):
    from d9d.kernels.rms_norm import TritonRmsNorm
    from d9d.kernels.swiglu import TritonSwiGlu

    norm, swiglu = TritonRmsNorm(), TritonSwiGlu()

    def run(mode):
        set_kernel_op_calls(mode)
        x = randn(2, 3, 48, seed=0, dtype=dtype).requires_grad_()
        residual = randn(2, 3, 48, seed=1, dtype=dtype).requires_grad_()
        weight = (1 + randn(48, seed=2, scale=0.1)).to(dtype).requires_grad_()
        out, summed = norm(x, weight, eps=1e-6, residual=residual)
        activated = swiglu(out, summed)
        (activated * randn(*activated.shape, seed=3, dtype=dtype)).sum().backward()
        return activated, x.grad, residual.grad, weight.grad

    for name, direct, dispatched in zip(
        ("out", "x", "residual", "weight"), run("direct"), run("dispatch"), strict=True
    ):
        # The same body runs on the same inputs either way: equal bits, not merely close.
        torch.testing.assert_close(direct, dispatched, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
