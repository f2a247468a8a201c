"""The Triton stochastic-rounding AdamW step through d9d-core's extension point (`StochasticAdamW(fused=True)`)."""

import pytest
import torch
from triton_cases import DEVICE, randn, requires_triton

from d9d.core.optim import StochasticAdamW, StochasticAdamWConfig, build_optimizer
from d9d.core.optim import fused_step as fused_step_module
from d9d.kernels.adamw import register_triton_stochastic_adamw

pytestmark = requires_triton
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    monkeypatch.setattr(fused_step_module, "_registered", [])
    monkeypatch.setattr(fused_step_module, "_registered_multi", [])
    register_triton_stochastic_adamw()


def _steps(optimizer, param, steps=3):
    for step in range(steps):
        param.grad = randn(*param.shape, seed=10 + step, dtype=param.dtype)
        optimizer.step()


def test_float32_params_follow_torch_adamw():
    ours = torch.nn.Parameter(randn(37, 5, seed=0))
    theirs = torch.nn.Parameter(ours.detach().clone())
    _steps(StochasticAdamW([ours], fused=True, **HYPER), ours)
    _steps(torch.optim.AdamW([theirs], foreach=False, **HYPER), theirs)
    # Same float32 operations; the kernel's sqrt/division may differ from PyTorch's by an ulp of float32.
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_bf16_params_land_within_one_ulp_of_the_pytorch_reference(state_dtype):
    """Both round the same float32 value stochastically (with different noise): each ends on one of its two bf16
    neighbours, so they differ by at most one bf16 ulp."""
    fused = torch.nn.Parameter(randn(300, seed=0, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(fused.detach().clone())
    _steps(StochasticAdamW([fused], fused=True, state_dtype=state_dtype, **HYPER), fused, steps=1)
    _steps(StochasticAdamW([plain], state_dtype=state_dtype, **HYPER), plain, steps=1)
    ulp = torch.finfo(torch.bfloat16).eps * plain.detach().float().abs()
    assert torch.all((fused.detach().float() - plain.detach().float()).abs() <= ulp * 1.0001)


def test_updates_below_half_an_ulp_survive_in_expectation():
    """1.0 - 1e-4 is not a bfloat16 (ulp below 1 is 2^-8); round-to-nearest would stay at 1.0 forever."""
    param = torch.nn.Parameter(torch.ones(16384, dtype=torch.bfloat16, device=DEVICE))
    optimizer = StochasticAdamW([param], fused=True, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
    param.grad = torch.ones_like(param)
    optimizer.step()  # first step: the update is exactly lr * sign(grad)
    values = param.detach().float()
    assert set(values.unique().tolist()) <= {1.0, 1.0 - 2**-8}
    # P(round down) = 1e-4 / 2^-8 = 0.0256: about 419 of 16384 elements, binomial std ~20; allow 5 std.
    assert abs(values.mean().item() - (1.0 - 1e-4)) < 5 * 20 * 2**-8 / 16384


def test_replicas_with_equal_seeds_stay_bit_equal_and_config_builds_the_fused_optimizer():
    params = [torch.nn.Parameter(randn(64, seed=0, dtype=torch.bfloat16)) for _ in range(2)]
    for param in params:
        _steps(build_optimizer(StochasticAdamWConfig(fused=True, seed=3, **HYPER), [param]), param)
    assert torch.equal(params[0], params[1])


def test_fused_without_a_registered_step_names_the_fix(monkeypatch):
    monkeypatch.setattr(fused_step_module, "_registered", [])
    with pytest.raises(ValueError, match="register_fused_stochastic_adamw_step"):
        StochasticAdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
