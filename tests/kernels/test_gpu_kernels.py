"""The GPU fast paths against the eager references (run on the GPU machine; skipped cleanly without CUDA)."""

import pytest
import torch
from backends import available_attention, available_grouped_mm

from d9d.kernels import detect_capabilities
from d9d.kernels.attention import AttentionMask, EagerAttention
from d9d.kernels.grouped_mm import EagerGroupedMm, build_grouped_mm

pytestmark = pytest.mark.gpu


def test_auto_selection_on_this_gpu_picks_a_fast_grouped_mm(monkeypatch):
    monkeypatch.delenv("D9D_BACKEND_AUTO_GROUPED_MM", raising=False)
    capabilities = detect_capabilities("cuda")
    backend = build_grouped_mm(capabilities=capabilities)
    if capabilities.cuda_at_least(9, 0):
        assert backend.name == "torch"


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_attention_backends_match_eager_on_cuda_bf16(documents):
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch, seq, heads, kv_heads, dim = 2, 256, 16, 8, 128
    q = torch.randn(batch, seq, heads, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    k = torch.randn(batch, seq, kv_heads, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    v = torch.randn(batch, seq, kv_heads, dim, device="cuda", generator=generator, dtype=torch.bfloat16)
    docs = torch.arange(seq, device="cuda").div(100, rounding_mode="floor").expand(batch, seq) if documents else None
    mask = AttentionMask(document_ids=docs)
    ref = EagerAttention()(q, k, v, mask=mask, scale=dim**-0.5).float()
    for backend in available_attention("cuda"):
        out = backend(q, k, v, mask=mask, scale=dim**-0.5).float()
        # bf16 outputs: one rounding (2^-8 relative) plus kernel-specific accumulation order.
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=lambda m, b=backend: f"{b.name}: {m}")


def test_grouped_mm_backends_match_eager_on_cuda_bf16_with_uneven_groups():
    generator = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.tensor([0, 37, 1, 300, 0, 129, 64, 5], device="cuda")
    hidden, ffn = 1024, 768
    x = torch.randn(int(sizes.sum()), hidden, device="cuda", generator=generator, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), ffn, hidden, device="cuda", generator=generator, dtype=torch.bfloat16) / 32
    grad = torch.randn(int(sizes.sum()), ffn, device="cuda", generator=generator, dtype=torch.bfloat16)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = EagerGroupedMm()(xr, wr, sizes)
    ref.backward(grad)
    for backend in available_grouped_mm("cuda"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = backend(xb, wb, sizes)
        out.backward(grad)
        for got, want in ((out, ref), (xb.grad, xr.grad), (wb.grad, wr.grad)):
            torch.testing.assert_close(
                got.float(), want.float(), atol=3e-2, rtol=2e-2, msg=lambda m, b=backend: f"{b.name}: {m}"
            )
