"""Attention backends against the eager reference, and the mask semantics (causal, packed documents)."""

import pytest
import torch
from backends import available_attention

from d9d.kernels.attention import AttentionMask, EagerAttention, SdpaAttention

EAGER = EagerAttention()
BACKENDS = [backend for backend in available_attention("cpu") if backend.name != "eager"]


def _qkv(batch=2, seq=12, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, seq, h, dim, generator=generator).to(dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7]])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_backend_matches_eager_forward_and_backward_fp32(backend, documents, kv_heads):
    mask = AttentionMask(document_ids=DOCS if documents else None)
    q, k, v = _qkv(kv_heads=kv_heads)
    scale = 16**-0.5
    out = backend(q, k, v, mask=mask, scale=scale)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = EAGER(q, k, v, mask=mask, scale=scale)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, t in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_backend_matches_eager_in_bf16(backend):
    # bf16 inputs: both compute softmax in float32 internally; outputs are rounded to bf16 (2^-8 relative).
    q, k, v = _qkv(dtype=torch.bfloat16)
    mask = AttentionMask(document_ids=DOCS)
    out = backend(q, k, v, mask=mask, scale=0.25)
    ref = EAGER(q, k, v, mask=mask, scale=0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", [EAGER, *BACKENDS], ids=lambda b: b.name)
def test_document_mask_equals_attending_each_document_alone(backend):
    q, k, v = _qkv(batch=1, seq=12)
    ids = DOCS[:1]
    packed = backend(q, k, v, mask=AttentionMask(document_ids=ids), scale=0.25)
    for doc in ids[0].unique():
        rows = (ids[0] == doc).nonzero().squeeze(-1)
        alone = backend(q[:, rows], k[:, rows], v[:, rows], mask=AttentionMask(), scale=0.25)
        torch.testing.assert_close(packed[:, rows], alone, atol=1e-5, rtol=1e-5)


def test_causal_mask_ignores_the_future():
    q, k, v = _qkv(batch=1)
    out = SdpaAttention()(q, k, v, mask=AttentionMask(), scale=0.25)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, 6:] += 10.0
    v2[:, 6:] -= 10.0
    changed = SdpaAttention()(q, k2, v2, mask=AttentionMask(), scale=0.25)
    torch.testing.assert_close(out[:, :6], changed[:, :6])
    assert not torch.allclose(out[:, 6:], changed[:, 6:])


def test_varlen_offsets_of_packed_rows():
    offsets, longest = AttentionMask(document_ids=DOCS).varlen_offsets()
    assert offsets.tolist() == [0, 3, 8, 12, 19, 24]
    assert offsets.dtype == torch.int32
    assert longest == 7


def test_shape_errors_name_the_shapes():
    q, k, v = _qkv(heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        EAGER(q, k, v, mask=AttentionMask(), scale=1.0)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_flex_attention_block_mask_matches_eager_forward_on_cpu(documents, kv_heads):
    # The CPU path of FlexAttention itself (no gradients: PyTorch has no CPU backward for it, the backend then uses
    # SDPA, covered above); float32 on both sides, so only summation order differs.
    from d9d.kernels.attention import FlexAttention

    mask = AttentionMask(document_ids=DOCS if documents else None)
    q, k, v = (t.detach() for t in _qkv(kv_heads=kv_heads))
    out = FlexAttention()(q, k, v, mask=mask, scale=0.25)
    torch.testing.assert_close(out, EAGER(q, k, v, mask=mask, scale=0.25), atol=1e-5, rtol=1e-5)
    assert any(key.startswith("derived:flex:") for key in mask._cache)  # built once, shared by every layer


_BUILDS: list[int] = []


def _doubled_documents(mask):
    _BUILDS.append(1)  # only ever called eagerly (traced code would guard on the list)
    return mask.document_ids * 2


def test_compiled_code_reads_the_same_graph_whether_the_mask_cache_is_empty_or_full():
    # What activation checkpointing needs of a compiled layer: its recomputation (the mask's cache full by then) runs
    # the graph its forward ran (cache empty for the first layer). The cache used to be traced, its keys guards.
    builds = _BUILDS

    def layer(x, mask):
        documents = mask.derived("doubled", lambda: _doubled_documents(mask))
        offsets, longest = mask.varlen_offsets()
        allowed = mask.dense(x.shape[1], x.device)
        return x.sum() + documents.sum() + offsets.sum() + longest + allowed.sum()

    compiled = torch.compile(layer, backend="aot_eager")
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    x = torch.randn(2, 5)
    want = layer(x, AttentionMask(document_ids=ids))
    builds.clear()
    torch._dynamo.reset()
    mask = AttentionMask(document_ids=ids)
    torch.testing.assert_close(compiled(x, mask), want, atol=0, rtol=0)  # the same ops, eager or traced
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            torch.testing.assert_close(compiled(x, mask), want, atol=0, rtol=0)
        torch.testing.assert_close(compiled(x, AttentionMask(document_ids=ids)), want, atol=0, rtol=0)
    assert len(builds) == 2  # the eager forms stay cached: once per mask, however many layers read them
