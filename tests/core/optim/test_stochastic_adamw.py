"""Stochastic-rounding AdamW: unbiased in expectation, close to float32 AdamW, reproducible, communication-free."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.core.optim import StochasticAdamW

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _bf16_param(value):
    """A bfloat16 parameter that takes float32 gradients (as the gradient synchroniser's fp32 buckets give)."""
    param = torch.nn.Parameter(value.to(torch.bfloat16))
    param.grad_dtype = torch.float32
    return param


def _grads(steps, size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator) for _ in range(steps)]


def test_float32_parameters_follow_torch_adamw_bit_for_bit():
    start = torch.randn(33, generator=torch.Generator().manual_seed(3))
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizers = [StochasticAdamW([ours], **HYPER), torch.optim.AdamW([theirs], foreach=False, **HYPER)]
    for grad in _grads(10, 33):
        for param, optimizer in zip((ours, theirs), optimizers, strict=True):
            param.grad = grad.clone()
            optimizer.step()
    assert torch.equal(ours, theirs)


TRIALS, SIZE, STEPS = 4096, 64, 20


def _trajectories(lr):
    """TRIALS independent bf16 runs (rows of one parameter) and the float32 AdamW run, on fixed gradients.

    The gradients do not depend on the parameters, so the moment estimates are the same in every run and the
    float32 trajectory is linear in the roundings: its expectation is exactly the float32 result.
    """
    hyper = {**HYPER, "lr": lr}
    start = torch.linspace(0.5, 2.0, SIZE).to(torch.bfloat16)
    bf16 = _bf16_param(start.expand(TRIALS, SIZE).clone())
    fp32 = torch.nn.Parameter(start.float().clone())
    nearest = torch.nn.Parameter(start.clone())
    optimizers = [
        StochasticAdamW([bf16], seed=11, **hyper),
        torch.optim.AdamW([fp32], foreach=False, **hyper),
        torch.optim.AdamW([nearest], foreach=False, **hyper),  # bf16 params, round-to-nearest
    ]
    for grad in _grads(STEPS, SIZE):
        bf16.grad = grad.expand(TRIALS, SIZE).contiguous()
        fp32.grad = grad.clone()
        nearest.grad = grad.to(torch.bfloat16)
        for optimizer in optimizers:
            optimizer.step()
    return bf16.detach().float(), fp32.detach(), nearest.detach().float()


def test_stochastic_rounding_adamw_is_unbiased_in_expectation():
    # Updates of lr=1e-4 are a fraction of a bfloat16 step (2^-7 .. 2^-6 here): round-to-nearest loses them.
    runs, expected, nearest = _trajectories(lr=1e-4)
    mean = runs.mean(0)
    standard_error = runs.std(0) / TRIALS**0.5
    moved = standard_error > 0
    z = (mean - expected)[moved] / standard_error[moved]
    assert moved.float().mean() > 0.9
    assert z.abs().max() < 6, f"an element is {z.abs().max():.1f} standard errors from the float32 result"
    assert z.mean().abs() < 4 / len(z) ** 0.5, f"mean z-score {z.mean():.3f}: a systematic bias"
    # Round-to-nearest is biased far beyond that (measured: 13.6 standard errors on average, 20x the mean error
    # of stochastic rounding): updates below half a step vanish.
    bias_nearest = (nearest - expected)[moved] / standard_error[moved]
    assert bias_nearest.abs().mean() > 8


def _regression(bf16, steps=30, seed=0):
    """Least squares fitted with AdamW; the loss and gradient are computed in float32 either way."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(256, 32, generator=generator)
    targets = inputs @ torch.randn(32, 4, generator=generator) + 0.1 * torch.randn(256, 4, generator=generator)
    start = (0.1 * torch.randn(32, 4, generator=generator)).to(torch.bfloat16)
    weight = _bf16_param(start.clone()) if bf16 else torch.nn.Parameter(start.float())
    hyper = {**HYPER, "lr": 5e-2}
    optimizer = StochasticAdamW([weight], seed=5, **hyper) if bf16 else torch.optim.AdamW([weight], **hyper)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (inputs @ weight.float() - targets).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses), weight.detach().float()


def test_bf16_stochastic_adamw_matches_fp32_adamw_over_a_short_run():
    """Tolerance: weights within 2% (relative L2) and every step's loss within 3% of float32 AdamW, 30 steps.

    Each write-back errs by less than one bfloat16 step (2^-8 relative), with mean zero and a standard deviation
    of at most half a step, so the weights drift from the float32 run like a random walk: about
    sqrt(30) * 2^-9 ~ 1.1% after 30 steps, and the loss by a comparable fraction. Measured over 8 seeds: weights
    0.62-0.81%, loss 0.35-1.4%.
    """
    losses_sr, weight_sr = _regression(bf16=True)
    losses_fp32, weight_fp32 = _regression(bf16=False)
    assert losses_sr[-1] < 0.1 * losses_sr[0], "it trains"
    assert ((losses_sr - losses_fp32).abs() / losses_fp32).max() < 3e-2
    assert (weight_sr - weight_fp32).norm() / weight_fp32.norm() < 2e-2


def test_bf16_moment_estimates_stay_close_too():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(256, generator=generator).to(torch.bfloat16)
    params = [_bf16_param(start.clone()) for _ in range(2)]
    optimizers = [
        StochasticAdamW([params[0]], seed=1, state_dtype=torch.float32, **HYPER),
        StochasticAdamW([params[1]], seed=1, state_dtype=torch.bfloat16, **HYPER),
    ]
    for grad in _grads(30, 256):
        for param, optimizer in zip(params, optimizers, strict=True):
            param.grad = grad.clone()
            optimizer.step()
    assert optimizers[1].state[params[1]]["exp_avg_sq"].dtype == torch.bfloat16
    assert (params[0].float() - params[1].float()).abs().max() < 4 * 2**-7


def test_the_state_dict_carries_the_rng_so_a_resumed_run_is_identical():
    def run(resume_at=None):
        param = _bf16_param(torch.linspace(-1, 1, 100))
        optimizer = StochasticAdamW([param], seed=9, **HYPER)
        for step, grad in enumerate(_grads(8, 100)):
            if step == resume_at:
                saved_param, saved_state = param.detach().clone(), optimizer.state_dict()
                param = _bf16_param(saved_param)
                optimizer = StochasticAdamW([param], seed=0, **HYPER)  # a different seed: the state must win
                optimizer.load_state_dict(saved_state)
            param.grad = grad
            optimizer.step()
        return param.detach()

    assert torch.equal(run(), run(resume_at=5))
    state = StochasticAdamW([torch.nn.Parameter(torch.ones(2))], seed=4).state_dict()
    assert state["rng"] == {"seed": 4, "counter": 0}


def test_loading_a_state_dict_keeps_float32_moments_of_bf16_parameters():
    """`Optimizer.load_state_dict` casts floating state to the parameter's dtype; the moments must stay float32."""
    param = _bf16_param(torch.linspace(-1, 1, 100))
    optimizer = StochasticAdamW([param], **HYPER)
    param.grad = _grads(1, 100)[0]
    optimizer.step()
    saved = optimizer.state_dict()
    resumed = StochasticAdamW([param], **HYPER)
    resumed.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert resumed.state[param][key].dtype == torch.float32
        assert torch.equal(resumed.state[param][key], saved["state"][0][key])


def test_the_step_count_lives_in_the_state_and_a_replaced_step_tensor_is_read_again():
    param = _bf16_param(torch.linspace(-1, 1, 8))
    optimizer = StochasticAdamW([param], **HYPER)
    for grad in _grads(3, 8):
        param.grad = grad
        optimizer.step()
    assert optimizer.state[param]["step"].item() == 3  # kept up to date for checkpoints, though counted in Python
    optimizer.state[param]["step"] = torch.tensor(10.0)
    optimizer.step()
    assert optimizer.state[param]["step"].item() == 11


@pytest.mark.distributed(world_size=4)
def test_dtensor_parameters_update_locally_and_replicas_stay_identical():
    mesh = DistributedContext.build(MeshDegrees(dp_replicate=2, dp_shard=2)).mesh_for(MeshDomain.DENSE)
    mesh = mesh["dp_replicate", "dp_cp_shard"]
    placements = [Replicate(), Shard(0)]
    full = torch.linspace(-1, 1, 64).to(torch.bfloat16).reshape(16, 4)
    param = torch.nn.Parameter(distribute_tensor(full, mesh, placements))
    param.grad_dtype = torch.float32
    optimizer = StochasticAdamW([param], seed=2, **{**HYPER, "lr": 1e-4})
    for grad in _grads(5, (16, 4)):
        param.grad = distribute_tensor(grad, mesh, placements)
        optimizer.step()
    assert isinstance(optimizer.state[param]["exp_avg"], type(param))
    gathered = [torch.empty_like(param.to_local()) for _ in range(4)]
    dist.all_gather(gathered, param.to_local())
    rank_of = mesh.mesh  # [replicate, shard] -> global rank
    for shard in range(2):
        first, second = (gathered[int(rank_of[replica, shard])] for replica in range(2))
        assert torch.equal(first, second), "the replicas of a shard rounded identically"
    # No communication: one rank alone can step (the others would be missing from any collective).
    if dist.get_rank() == 3:
        before = param.to_local().clone()
        param.grad = distribute_tensor(torch.ones(16, 4), mesh, placements, src_data_rank=None)
        optimizer.step()
        assert not torch.equal(before, param.to_local())
