"""RoPE: frequencies (linear, NTK, YaRN) against transformers' formulas, both rotation styles, partial rotation."""

import math

import pytest
import torch

from d9d.models.blocks import (
    LinearRopeScaling,
    NtkRopeScaling,
    RopeStyle,
    RotaryEmbedding,
    YarnRopeScaling,
    rope_frequencies,
)


def _hf_inv_freq(rope_parameters, head_dim=64):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # The legacy keywords (rope_theta, rope_scaling) work with transformers 4.x and 5.x alike.
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    config = Qwen3Config(
        head_dim=head_dim, max_position_embeddings=8192, rope_theta=rope_parameters["rope_theta"], rope_scaling=scaling
    )
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (LinearRopeScaling(factor=4.0), {"rope_type": "linear", "factor": 4.0}),
        (
            YarnRopeScaling(factor=4.0, original_max_position_embeddings=2048),
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        ),
        (
            YarnRopeScaling(
                factor=8.0,
                original_max_position_embeddings=1024,
                beta_fast=16,
                mscale=1.0,
                mscale_all_dim=0.5,
                truncate=False,
            ),
            {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        ),
    ],
    ids=["linear", "yarn", "yarn-mscale"],
)
def test_scaled_frequencies_match_transformers(ours, theirs):
    inverse, factor = rope_frequencies(64, 1e6, ours)
    hf_inverse, hf_factor = _hf_inv_freq({**theirs, "rope_theta": 1e6})
    torch.testing.assert_close(inverse, hf_inverse.float())
    assert factor == pytest.approx(hf_factor)


def test_ntk_keeps_the_highest_frequency_and_stretches_the_lowest_by_the_factor():
    plain, _ = rope_frequencies(64, 1e4, None)
    ntk, _ = rope_frequencies(64, 1e4, NtkRopeScaling(factor=8.0))
    assert ntk[0] == plain[0]
    assert plain[-1] / ntk[-1] == pytest.approx(8.0, rel=1e-5)
    assert torch.all(ntk <= plain)


def _rotate(style, rotary_dim=None, positions=None, dim=32):
    rope = RotaryEmbedding(head_dim=dim, theta=1e4, rotary_dim=rotary_dim, style=style)
    positions = torch.arange(7)[None] if positions is None else positions
    return rope(positions, torch.float32)


def test_half_style_matches_transformers_apply_rotary():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    tables = _rotate(RopeStyle.HALF)
    q, k = torch.randn(1, 7, 4, 32), torch.randn(1, 7, 2, 32)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), tables.cos, tables.sin)
    torch.testing.assert_close(tables.apply(q), hf_q.transpose(1, 2))
    torch.testing.assert_close(tables.apply(k), hf_k.transpose(1, 2))


def test_interleaved_style_is_half_style_on_reordered_channels():
    # Interleaved rotates pairs (2i, 2i+1); half rotates (i, i + d/2). Reordering channels maps one onto the other.
    x = torch.randn(1, 7, 3, 32)
    evens_then_odds = torch.cat([torch.arange(0, 32, 2), torch.arange(1, 32, 2)])
    interleaved = _rotate(RopeStyle.INTERLEAVED).apply(x)
    half = _rotate(RopeStyle.HALF).apply(x[..., evens_then_odds])
    torch.testing.assert_close(interleaved[..., evens_then_odds], half)


@pytest.mark.parametrize("style", list(RopeStyle))
def test_scores_depend_only_on_relative_position(style):
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(pq, pk):
        tq = _rotate(style, positions=torch.tensor([[pq]]))
        tk = _rotate(style, positions=torch.tensor([[pk]]))
        return (tq.apply(q) * tk.apply(k)).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 4))


@pytest.mark.parametrize("style", list(RopeStyle))
def test_partial_rotation_keeps_the_tail_and_the_norm(style):
    tables = _rotate(style, rotary_dim=16)
    x = torch.randn(1, 7, 2, 32)
    out = tables.apply(x)
    torch.testing.assert_close(out[..., 16:], x[..., 16:])
    torch.testing.assert_close(out[..., :16].norm(dim=-1), x[..., :16].norm(dim=-1))
    assert not torch.allclose(out[:, 1:, :, :16], x[:, 1:, :, :16])


def test_yarn_scales_cos_and_sin_by_the_attention_factor():
    rope = RotaryEmbedding(
        head_dim=32, theta=1e4, scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=64)
    )
    tables = rope(torch.zeros(1, 1, dtype=torch.long), torch.float32)
    assert tables.cos[0, 0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_odd_rotary_dim_is_refused():
    with pytest.raises(ValueError, match="rotary_dim=15 must be even"):
        RotaryEmbedding(head_dim=32, theta=1e4, rotary_dim=15)
