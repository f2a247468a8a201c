"""Triton SwiGLU against `silu(gate) * up`, forward and backward, fp32 and bf16."""

import pytest
import torch
from triton_cases import DTYPES, close, randn, requires_triton

from d9d.kernels.swiglu import EagerSwiGlu, TritonSwiGlu

pytestmark = requires_triton
SHAPE = (3, 5, 70)  # 1050 elements: more than one block, with a masked tail


def _run(backend, dtype):
    gate = randn(*SHAPE, seed=0, dtype=dtype, scale=3.0).requires_grad_()  # wide range: both tails of the sigmoid
    up = randn(*SHAPE, seed=1, dtype=dtype).requires_grad_()
    out = backend(gate, up)
    out.backward(randn(*SHAPE, seed=2, dtype=dtype))
    return out, gate.grad, up.grad


@DTYPES
def test_triton_swiglu_matches_eager_forward_and_backward(dtype):
    for name, got, want in zip(
        ("out", "gate", "up"), _run(TritonSwiGlu(), dtype), _run(EagerSwiGlu(), dtype), strict=True
    ):
        assert got.dtype == dtype
        close(got, want, dtype, msg=name)


def test_split_backward_is_the_autograd_backward_and_ops_pass_opcheck():
    from d9d.kernels.swiglu import ops

    gate, up, grad = randn(40, seed=0), randn(40, seed=1), randn(40, seed=2)
    grad_gate, grad_up = ops.swiglu_backward_input(grad, gate, up)
    gs, us = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (torch.nn.functional.silu(gs) * us).backward(grad)
    close(grad_gate, gs.grad, torch.float32)
    close(grad_up, us.grad, torch.float32)
    torch.library.opcheck(torch.ops.d9d_kernels.swiglu_forward, (gate, up))
    torch.library.opcheck(torch.ops.d9d_kernels.swiglu_backward_input, (grad, gate, up))


def test_torch_compile_traces_through_without_graph_breaks():
    backend = TritonSwiGlu()
    gate, up = randn(8, 16, seed=0).requires_grad_(), randn(8, 16, seed=1)
    compiled = torch.compile(lambda g, u: backend(g, u).sum(), backend="aot_eager", fullgraph=True)
    compiled(gate, up).backward()
    close(gate.grad, torch.autograd.grad(EagerSwiGlu()(gate, up).sum(), gate)[0], torch.float32)


def test_mismatched_shapes_name_both():
    with pytest.raises(ValueError, match=r"got \(4,\) torch.float32 and \(5,\)"):
        TritonSwiGlu()(randn(4, seed=0), randn(5, seed=1))


def _row_counts() -> list[int]:
    """Rows an expert-parallel rank's grouped experts see over 24 steps and layers: a different count every time,
    the way the all-to-all and DeepEP dispatchers deliver them (between 40 and 120 rows here)."""
    generator = torch.Generator().manual_seed(0)
    return sorted(set(torch.randint(40, 121, (24,), generator=generator).tolist()))


def _tuning_keys(kernel, monkeypatch, launch, rows_list):
    """The autotuning key of every launch of `kernel` (Triton's `Autotuner`, which benchmarks every config for each
    new key value), recorded on the real launches."""
    keys = []
    run = kernel.run

    def recording_run(*args, **kwargs):
        named = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
        keys.append(tuple(named[name] for name in kernel.keys))
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", recording_run)
    for rows in rows_list:
        launch(rows)
    return keys


def test_tuning_keys_do_not_follow_the_row_count(monkeypatch):
    """Regression: keyed on `n_elements`, each new row count of an expert-parallel step (every step and layer)
    re-ran the whole autotuning benchmark on GPUs, forward and backward: the MoE anchor at ep=2 took 7.9 s a step
    instead of about 0.15 s. Keys now take one value per power-of-two size class."""
    from d9d.kernels.swiglu import triton_kernels

    cols = 16
    rows_list = _row_counts()
    assert len(rows_list) > 10
    classes = {1 << (rows * cols - 1).bit_length() for rows in rows_list}  # 640..1920 elements: 1024 and 2048

    def forward(rows):
        triton_kernels.forward(randn(rows, cols, seed=rows), randn(rows, cols, seed=rows + 1))

    def backward(rows):
        triton_kernels.backward(*(randn(rows, cols, seed=rows + i) for i in range(3)))

    for kernel, launch in ((triton_kernels._forward_kernel, forward), (triton_kernels._backward_kernel, backward)):
        keys = _tuning_keys(kernel, monkeypatch, launch, rows_list)
        assert len(keys) == len(rows_list)
        assert len(set(keys)) == len(classes) == 2, f"{len(set(keys))} tuning keys for {len(rows_list)} row counts"
