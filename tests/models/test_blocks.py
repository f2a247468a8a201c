"""Blocks on their own: chunked loss, split vocabulary, RMSNorm, late initialisation, checkpointing, positions."""

import pytest
import torch
from tiny import EAGER, d9d_from_hf, hf_dense
from torch.nn import functional

from d9d.models import PipelineStage, materialize_
from d9d.models.blocks import (
    RMSNorm,
    SplitLanguageModellingHead,
    SplitTokenEmbedding,
    chunked_linear_cross_entropy,
    positions_within_documents,
)


def _loss_inputs(dtype=torch.float32, tokens=37, hidden=24, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) / 4).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::5] = -100
    return h, w, labels


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
def test_chunked_loss_matches_full_cross_entropy_fp32(chunk_size):
    h, w, labels = _loss_inputs()
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    losses = chunked_linear_cross_entropy(h, w, labels, chunk_size=chunk_size)
    (losses * weights).sum().backward()
    got = (losses.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref = functional.cross_entropy(h @ w.T, labels, reduction="none")
    (ref * weights).sum().backward()
    assert losses.dtype == torch.float32
    assert torch.all(losses[::5] == 0)
    for mine, theirs in zip(got, (ref.detach(), h.grad, w.grad), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_chunked_loss_in_bf16_is_as_accurate_as_a_full_bf16_cross_entropy():
    h, w, labels = _loss_inputs(torch.bfloat16, tokens=64, vocab=200)
    exact = functional.cross_entropy(h.double() @ w.double().T, labels, reduction="none")
    ours = chunked_linear_cross_entropy(h, w, labels, chunk_size=16)
    theirs = functional.cross_entropy((h @ w.T).float(), labels, reduction="none")
    # Both round the logits to bf16 once and reduce in float32: the same error against exact arithmetic.
    assert (ours.double() - exact).abs().max() <= 1.5 * (theirs.double() - exact).abs().max() + 1e-6


def test_chunked_loss_keeps_batch_shape():
    h, w, labels = _loss_inputs(tokens=12)
    losses = chunked_linear_cross_entropy(h.view(3, 4, -1), w, labels.view(3, 4), chunk_size=5)
    assert losses.shape == (3, 4)
    with pytest.raises(ValueError, match="disagree on the token count"):
        chunked_linear_cross_entropy(h, w, labels[:-1])


def test_split_embedding_and_head_equal_one_table_and_train_segments_separately():
    with torch.device("meta"):
        embedding = SplitTokenEmbedding({"regular": 10, "special": 3}, 8)
        head = SplitLanguageModellingHead({"regular": 10, "special": 3}, 8, loss_chunk_size=4)
    materialize_(embedding, "cpu")
    materialize_(head, "cpu")
    ids = torch.tensor([[0, 9, 10, 12, 5]])
    table = torch.cat([embedding.segments["regular"].weight, embedding.segments["special"].weight])
    torch.testing.assert_close(embedding(ids), table[ids])
    hidden = embedding(ids)
    torch.testing.assert_close(head.logits(hidden), hidden @ head.weight().T)
    head(hidden, torch.tensor([[1, 2, 11, 0, -100]])).loss_sum.backward()
    special = embedding.segments["special"].weight.grad
    assert torch.count_nonzero(special.abs().sum(-1)) == 2  # ids 10 and 12
    assert embedding.segments["regular"].weight.grad is not None


def test_rmsnorm_matches_transformers_in_bf16():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x = torch.randn(3, 5, 16).to(torch.bfloat16)
    ours, theirs = RMSNorm(16, eps=1e-6), Qwen3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.linspace(0.5, 1.5, 16))
        theirs.weight.copy_(ours.weight)
    assert torch.equal(ours.to(torch.bfloat16)(x), theirs.to(torch.bfloat16)(x))


def test_meta_build_and_materialize_is_deterministic_and_initialises_everything():
    hf = hf_dense()
    _, params = d9d_from_hf(hf)
    from d9d.models.qwen3 import Qwen3DenseForCausalLM

    def build():
        torch.manual_seed(123)
        with torch.device("meta"):
            model = Qwen3DenseForCausalLM(params, config=EAGER)
        return materialize_(model, "cpu")

    first, second = build(), build()
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name
    norm = first.model.layers["0"].input_layernorm.weight
    assert torch.all(norm == 1)
    assert first.model.layers["0"].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.2)
    torch.testing.assert_close(first.model.rotary_emb.inv_freq, 1.0 / (1e4 ** (torch.arange(0, 16, 2) / 16)))


def test_activation_checkpointing_gives_the_same_gradients():
    hf = hf_dense()
    plain, _ = d9d_from_hf(hf)
    checkpointed, _ = d9d_from_hf(hf, config=EAGER.model_copy(update={"activation_checkpointing": [0, 2]}))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for model in (plain, checkpointed):
        model(ids, labels=ids).losses.sum().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_positions_restart_in_every_packed_document():
    ids = torch.tensor([[4, 4, 4, 9, 9, 1], [2, 2, 2, 2, 2, 2]])
    assert positions_within_documents(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_packed_documents_give_each_document_its_unpacked_logits():
    model, _ = d9d_from_hf(hf_dense())
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    packed = model(ids, document_ids=documents).logits
    torch.testing.assert_close(packed[:, :4], model(ids[:, :4]).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 4:], model(ids[:, 4:]).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("count", "pre", "post", "expected"),
    [(2, 0, 0, [[0, 1, 2], [3, 4, 5]]), (4, 1, 1, [[0], [1, 2], [3, 4], [5]]), (3, 0, 0, [[0, 1], [2, 3], [4, 5]])],
)
def test_stage_layer_distribution(count, pre, post, expected):
    got = [list(PipelineStage(i, count, pre, post).layers(6)) for i in range(count)]
    assert got == expected


def test_stage_errors():
    with pytest.raises(ValueError, match="stage index 2 is outside"):
        PipelineStage(2, 2)
    with pytest.raises(ValueError, match="cannot fill 4 stages"):
        PipelineStage(0, 4).layers(3)
