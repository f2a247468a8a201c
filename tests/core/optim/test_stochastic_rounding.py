"""Stochastic rounding float32 -> bfloat16 is unbiased: its mean converges to the exact value (a z-test)."""

import torch

from d9d.core.optim import random_low_bits, stochastic_round_to_bf16

DRAWS = 4096


def _bf16_neighbours(values):
    """The bfloat16 values just below and above each float32 value in magnitude, and the fraction between."""
    truncated = (values.view(torch.int32) & -(1 << 16)).view(torch.float32)
    step = (truncated.abs().view(torch.int32) + (1 << 16)).view(torch.float32) - truncated.abs()
    fraction = (values.abs() - truncated.abs()) / step
    return truncated, step, fraction


def test_mean_of_stochastic_rounding_equals_the_value():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(512, generator=generator, dtype=torch.float32) * torch.logspace(-6, 6, 512)
    noise = random_low_bits(torch.Size([DRAWS, 512]), generator=generator, device=torch.device("cpu"))
    rounded = stochastic_round_to_bf16(values.expand(DRAWS, 512).contiguous(), noise).float()
    _, step, fraction = _bf16_neighbours(values)
    # Each draw is one of two neighbours: a Bernoulli(fraction) times the step, so the standard error is known.
    standard_error = step * torch.sqrt(fraction * (1 - fraction) / DRAWS).clamp_min(1e-30)
    z = (rounded.mean(0) - values) / standard_error
    exact = fraction == 0
    assert torch.all(rounded[:, exact] == values[exact]), "representable values never move"
    z = z[~exact]
    assert z.abs().max() < 6, f"some element is {z.abs().max():.1f} standard errors off"
    assert z.mean().abs() < 4 / len(z) ** 0.5, f"mean z-score {z.mean():.3f}: a systematic bias"


def test_rounding_lands_only_on_the_two_neighbours_and_round_to_nearest_is_biased():
    one_and_a_quarter_step = torch.tensor([1.0 + 2**-7 / 4, -(1.0 + 2**-7 / 4)], dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    noise = random_low_bits(torch.Size([DRAWS, 2]), generator=generator, device=torch.device("cpu"))
    rounded = stochastic_round_to_bf16(one_and_a_quarter_step.expand(DRAWS, 2).contiguous(), noise).float()
    assert set(rounded[:, 0].tolist()) == {1.0, 1.0 + 2**-7}
    assert set(rounded[:, 1].tolist()) == {-1.0, -(1.0 + 2**-7)}
    # About a quarter of the draws go up, so the mean is within a few standard errors of the value...
    assert abs(rounded[:, 0].mean().item() - one_and_a_quarter_step[0].item()) < 4 * 2**-7 * (0.1875 / DRAWS) ** 0.5
    # ...while round-to-nearest always returns 1.0: a bias of a quarter step on every update.
    assert one_and_a_quarter_step.to(torch.bfloat16).float().tolist() == [1.0, -1.0]


def test_special_values_survive():
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    noise = torch.full((5,), (1 << 16) - 1, dtype=torch.int32)
    rounded = stochastic_round_to_bf16(values, noise)
    assert rounded[:4].tolist() == [0.0, -0.0, float("inf"), float("-inf")]
    assert torch.isnan(rounded[4])
