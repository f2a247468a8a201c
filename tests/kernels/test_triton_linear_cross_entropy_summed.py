"""The summed fused linear + cross-entropy (gradients computed in forward, backward scales them) against the
full-logits reference reduced by a sum, and the float32 weight-gradient accumulation.

Tolerances (`close` in triton_cases.py): fp32 1e-5 — the same float32 softmax and matmuls, only the summation order
differs. bf16: losses 1e-2 (float32 statistics of the same bf16 logits; the interpreter truncates where the GPU
rounds); gradients 3e-2: the logits gradient is rounded to bf16 once per element in both, the gradient matmuls are
bf16, and the summed path rounds the hidden-state gradient once more when it scales it by the incoming scalar
(one more bf16 ulp, 2^-8 relative), while its weight gradient is scaled in float32 and rounded once.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_cases import DTYPES, close, randn, requires_triton

from d9d.kernels import BackendUnavailable
from d9d.kernels.linear_cross_entropy import (
    IGNORE_INDEX,
    EagerLinearCrossEntropy,
    TritonLinearCrossEntropy,
    addmm_float32_,
    linear_cross_entropy_reference,
)
from d9d.kernels.linear_cross_entropy.accumulate import fused_float32_addmm_supported

TOKENS, HIDDEN, VOCAB, CHUNK = 13, 16, 100, 4  # 4 chunks, the last one short; vocab not a power of two
SCALE = 0.37  # what a task multiplies the sum by (1 / tokens): not a power of two, so scaling rounds


def _inputs(dtype, tokens=TOKENS, seed=0):
    hidden = randn(tokens, HIDDEN, seed=seed, dtype=dtype)
    weight = randn(VOCAB, HIDDEN, seed=1, dtype=dtype, scale=0.5)
    labels = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed + 2)).to(hidden.device)
    labels[[1, 7]] = IGNORE_INDEX
    return hidden, weight, labels


def _backends():
    backends = [EagerLinearCrossEntropy()]
    with contextlib.suppress(BackendUnavailable):  # triton missing: only the eager backend runs here
        backends.append(TritonLinearCrossEntropy())
    return backends


BACKENDS = pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@DTYPES
@BACKENDS
def test_summed_loss_and_gradients_match_the_full_logits_reference(backend, dtype):
    hidden, weight, labels = _inputs(dtype)
    h, w = _leaves(hidden, weight)
    summed = backend.summed(h, w, labels, chunk_size=CHUNK)
    (summed.total * SCALE).backward()
    rh, rw = _leaves(hidden, weight)
    want = linear_cross_entropy_reference(rh, rw, labels)
    (want.sum() * SCALE).backward()
    assert summed.total.shape == () and summed.total.dtype == torch.float32
    assert not summed.losses.requires_grad and summed.losses.shape == labels.shape
    assert torch.all(summed.losses[[1, 7]] == 0) and torch.all(h.grad[[1, 7]] == 0)  # ignored: no loss, no grad
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    close(summed.losses, want, dtype, bf16=1e-2, msg="losses")
    close(summed.total, want.sum(), dtype, fp32=1e-5, bf16=1e-2, msg="total")
    close(h.grad, rh.grad, dtype, bf16=3e-2, msg="grad hidden")
    close(w.grad, rw.grad, dtype, bf16=3e-2, msg="grad weight")


@BACKENDS
def test_two_micro_batches_accumulate_to_the_gradient_of_the_whole_sum(backend):
    hidden, weight, labels = _inputs(torch.float32, tokens=2 * TOKENS)
    h, w = _leaves(hidden, weight)
    for rows in (slice(0, TOKENS), slice(TOKENS, 2 * TOKENS)):  # each forward computes its own gradients
        (backend.summed(h[rows], w, labels[rows], chunk_size=CHUNK).total * SCALE).backward()
    rh, rw = _leaves(hidden, weight)
    (linear_cross_entropy_reference(rh, rw, labels).sum() * SCALE).backward()
    close(h.grad, rh.grad, torch.float32, msg="grad hidden")
    close(w.grad, rw.grad, torch.float32, msg="grad weight")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_forward_runs_one_logits_matmul_per_chunk_and_backward_none():
    # Eager backend: its matmuls are visible to a dispatch mode (the Triton one runs them inside a custom op).
    hidden, weight, labels = _inputs(torch.float32)
    chunks = -(-TOKENS // CHUNK)
    h, w = _leaves(hidden, weight)
    with _CountMatmuls() as forward:
        summed = EagerLinearCrossEntropy().summed(h, w, labels, chunk_size=CHUNK)
    with _CountMatmuls() as backward:
        summed.total.backward()
    assert (forward.count, backward.count) == (3 * chunks, 0)  # logits, grad hidden, grad weight; then a scaling
    with torch.no_grad(), _CountMatmuls() as no_grad:  # evaluation: the statistics only
        EagerLinearCrossEntropy().summed(h, w, labels, chunk_size=CHUNK)
    assert no_grad.count == chunks
    frozen = weight.detach()  # a frozen head (adapters): no weight gradient is formed
    with _CountMatmuls() as input_only:
        summed = EagerLinearCrossEntropy().summed(h, frozen, labels, chunk_size=CHUNK)
    assert input_only.count == 2 * chunks
    assert summed.total.requires_grad


def test_bad_chunk_and_token_counts_are_named():
    hidden, weight, labels = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size must be positive, got -1"):
        EagerLinearCrossEntropy().summed(hidden, weight, labels, chunk_size=-1)
    with pytest.raises(ValueError, match="disagree on the token count"):
        EagerLinearCrossEntropy().summed(hidden, weight, labels[:-1])


@requires_triton
def test_the_custom_op_passes_opcheck_for_every_wanted_half():
    from d9d.kernels.linear_cross_entropy import ops  # noqa: F401 - registers the op

    hidden, weight, labels = _inputs(torch.float32)
    for want_input, want_weight in ((True, True), (True, False), (False, True), (False, False)):
        torch.library.opcheck(
            torch.ops.d9d_kernels.linear_cross_entropy_with_gradients,
            (hidden, weight, labels, CHUNK, want_input, want_weight),
        )


@requires_triton
def test_torch_compile_traces_the_summed_path_without_graph_breaks():
    backend = TritonLinearCrossEntropy()
    hidden, weight, labels = _inputs(torch.float32)
    h, w = _leaves(hidden, weight)
    compiled = torch.compile(
        lambda a, b: backend.summed(a, b, labels, chunk_size=CHUNK).total * SCALE, backend="aot_eager", fullgraph=True
    )
    compiled(h, w).backward()
    rh, rw = _leaves(hidden, weight)
    (linear_cross_entropy_reference(rh, rw, labels).sum() * SCALE).backward()
    close(h.grad, rh.grad, torch.float32, msg="grad hidden")
    close(w.grad, rw.grad, torch.float32, msg="grad weight")


@DTYPES
def test_float32_accumulation_adds_the_product_in_place(dtype):
    a, b = randn(7, 5, seed=4, dtype=dtype), randn(5, 9, seed=5, dtype=dtype)
    acc = randn(7, 9, seed=6)
    want = acc + (a @ b).float()
    got = addmm_float32_(acc, a, b)
    assert got is acc and acc.dtype == torch.float32
    close(acc, want, torch.float32)
    assert not fused_float32_addmm_supported(torch.device("cpu"), torch.bfloat16)  # CPU: product, then add
