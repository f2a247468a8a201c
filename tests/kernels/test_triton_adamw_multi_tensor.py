"""The multi-tensor Triton AdamW step: one launch per bucket, bit for bit the per-tensor step's result.

On CPU the kernels run in Triton's interpreter; the fixture shrinks its blocks to 64 elements, so the small tensors
here span several blocks, end in partial ones, or have none (empty).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from triton_cases import DEVICE, randn, requires_triton

from d9d.core.optim import AdamWStepParameters, StochasticAdamW
from d9d.core.optim import fused_step as fused_step_module
from d9d.kernels.adamw import multi_tensor as multi_tensor_module
from d9d.kernels.adamw import register_triton_stochastic_adamw, triton_stochastic_adamw_step
from d9d.kernels.adamw.multi_tensor import block_map, stochastic_adamw_multi_step

pytestmark = requires_triton
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# Not multiples of the 64-element interpreter block; one element; empty; 1-D and 2-D.
SHAPES = [(130,), (1,), (0,), (7, 33), (64,), (3, 100), (65,)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    monkeypatch.setattr(fused_step_module, "_registered", [])
    monkeypatch.setattr(fused_step_module, "_registered_multi", [])
    monkeypatch.setattr(multi_tensor_module, "INTERPRETER_BLOCK", 64)
    register_triton_stochastic_adamw()


def _bits(tensor):
    """The tensor's bit pattern (torch.equal on floats would take -0.0 for 0.0)."""
    local = tensor.detach()
    local = local.to_local() if isinstance(local, DTensor) else local
    return local.contiguous().view(torch.int16 if local.element_size() == 2 else torch.int32)


def _assert_same_bits(got, want, what):
    assert got.dtype == want.dtype, what
    assert torch.equal(_bits(got), _bits(want)), f"{what} differs in its bits"


def _slots(shapes, param_dtype, state_dtype, seed):
    """(param, grad, exp_avg, exp_avg_sq) per shape: plausible values (non-negative second moments)."""
    slots = []
    for number, shape in enumerate(shapes):
        base = seed * 100 + number * 4
        slots.append([
            randn(*shape, seed=base, dtype=param_dtype),
            randn(*shape, seed=base + 1, dtype=param_dtype),
            randn(*shape, seed=base + 2, dtype=state_dtype, scale=0.1),
            randn(*shape, seed=base + 3, dtype=state_dtype).square(),
        ])  # fmt: skip
    return slots


# Every size a multiple of 16 (and CPU allocations 64-byte aligned): the kernel's `ALIGNED` path (128-bit accesses).
ALIGNED_SHAPES = [(160,), (4, 48), (0,), (16,)]


@pytest.mark.parametrize("param_dtype", DTYPES.values(), ids=[f"{name}-params" for name in DTYPES])
@pytest.mark.parametrize("state_dtype", DTYPES.values(), ids=[f"{name}-moments" for name in DTYPES])
@pytest.mark.parametrize("shapes", [SHAPES, ALIGNED_SHAPES], ids=["odd-sizes", "aligned"])
def test_one_launch_gives_the_per_tensor_bits_for_every_size(param_dtype, state_dtype, shapes):
    per_tensor = _slots(shapes, param_dtype, state_dtype, seed=1)
    multi = copy.deepcopy(per_tensor)
    start = copy.deepcopy(per_tensor)
    if shapes is ALIGNED_SHAPES:  # the case exercises the path it names
        assert all(tensor.data_ptr() % 16 == 0 for slots in multi for tensor in slots)
    for step in (1, 2, 3):  # the step count and the seeds change from step to step, as in the optimizer
        hyper = AdamWStepParameters(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        # Large seeds too: the launcher folds 63-bit seeds to Philox's 32 bits as the per-tensor step does.
        seeds = [(2**62 + 3 * i + step, 2**40 * i + step, 7 * i + 100 * step) for i in range(len(shapes))]
        for slots, triple in zip(per_tensor, seeds, strict=True):
            triton_stochastic_adamw_step(*slots, hyper=hyper, seeds=triple)
        stochastic_adamw_multi_step(*(list(column) for column in zip(*multi, strict=True)), hyper=hyper, seeds=seeds)
    for shape, want, got, before in zip(shapes, per_tensor, multi, start, strict=True):
        for name, w, g, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), want, got, before, strict=True):
            _assert_same_bits(g, w, f"{name} of shape {shape}")
            if name != "grad" and w.numel():
                assert not torch.equal(w, b), f"{name} of shape {shape} was updated"


def test_the_block_map_covers_each_tensor_block_by_block_and_is_cached():
    mapping = block_map((130, 0, 1, 64), 64, torch.device(DEVICE))
    assert mapping.tolist() == [[0, 0], [0, 1], [0, 2], [2, 0], [3, 0]]  # tensor 1 is empty: no block
    assert block_map((130, 0, 1, 64), 64, torch.device(DEVICE)) is mapping


def test_a_mixed_bucket_is_refused_naming_the_tensors():
    (param, grad, exp_avg, exp_avg_sq), other = _slots([(5,), (5,)], torch.float32, torch.float32, seed=0)
    hyper = AdamWStepParameters(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    mixed = [param, other[0].to(torch.bfloat16)]
    with pytest.raises(ValueError, match=r"one dtype per role.*param \(5,\) torch.bfloat16"):
        stochastic_adamw_multi_step(
            mixed, [grad, other[1]], [exp_avg, other[2]], [exp_avg_sq, other[3]], hyper=hyper, seeds=[(1, 2, 3)] * 2
        )
    with pytest.raises(ValueError, match="2 params, 1 grads"):
        stochastic_adamw_multi_step(
            [param, other[0]], [grad], [exp_avg, other[2]], [exp_avg_sq, other[3]], hyper=hyper, seeds=[(1, 2, 3)] * 2
        )


def _model_params(dtype_of):
    """Parameters of several shapes and dtypes (fp32 and bf16: separate buckets) in two groups."""
    params = [
        torch.nn.Parameter(randn(*shape, seed=number, dtype=dtype_of(number))) for number, shape in enumerate(SHAPES)
    ]
    return params, [{"params": params[:4]}, {"params": params[4:], "lr": 3e-3, "weight_decay": 0.0}]


def _train(optimizer, params, steps, *, first=0, skip=None):
    """`steps` steps on fixed gradients; parameter `skip` gets no gradient on step 1 (its step count falls behind,
    so its group splits into buckets by step count)."""
    for step in range(first, first + steps):
        for number, param in enumerate(params):
            grad = randn(*param.shape, seed=1000 + 10 * step + number, dtype=param.dtype)
            param.grad = None if (step == 1 and number == skip) else grad
        optimizer.step()


def _mixed_dtypes(number):
    return torch.bfloat16 if number % 2 else torch.float32


@pytest.mark.parametrize("state_dtype", DTYPES.values(), ids=[f"{name}-moments" for name in DTYPES])
def test_the_optimizer_with_the_multi_tensor_step_matches_the_per_tensor_loop_bitwise(state_dtype):
    results = []
    for multi_tensor in (False, True):
        register_triton_stochastic_adamw(multi_tensor=multi_tensor)
        params, groups = _model_params(_mixed_dtypes)
        optimizer = StochasticAdamW(groups, fused=True, seed=5, state_dtype=state_dtype, **HYPER)
        assert (optimizer.fused_multi_step is not None) == multi_tensor
        _train(optimizer, params, steps=4, skip=3)
        results.append((params, optimizer))
    (loop_params, loop_optimizer), (multi_params, multi_optimizer) = results
    for number, (want, got) in enumerate(zip(loop_params, multi_params, strict=True)):
        _assert_same_bits(got, want, f"parameter {number}")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_same_bits(multi_optimizer.state[got][key], loop_optimizer.state[want][key], f"{key} {number}")
        assert multi_optimizer.state[got]["step"].item() == (3 if number == 3 else 4)


def test_float32_params_follow_torch_adamw_through_the_multi_tensor_step():
    params, groups = _model_params(lambda number: torch.float32)
    theirs, their_groups = _model_params(lambda number: torch.float32)
    _train(StochasticAdamW(groups, fused=True, **HYPER), params, steps=3)
    _train(torch.optim.AdamW(their_groups, foreach=False, **HYPER), theirs, steps=3)
    for ours, reference in zip(params, theirs, strict=True):
        # The same float32 operations; the kernel's sqrt/division may differ from PyTorch's by an ulp of float32.
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("state_dtype", DTYPES.values(), ids=[f"{name}-moments" for name in DTYPES])
def test_bf16_params_land_within_one_ulp_of_the_pytorch_reference(state_dtype):
    """Both round the same float32 value stochastically (with different noise): each ends on one of its two bf16
    neighbours, so after one step they differ by at most one bf16 ulp."""
    fused_params, fused_groups = _model_params(lambda number: torch.bfloat16)
    plain_params, plain_groups = _model_params(lambda number: torch.bfloat16)
    _train(StochasticAdamW(fused_groups, fused=True, state_dtype=state_dtype, **HYPER), fused_params, steps=1)
    _train(StochasticAdamW(plain_groups, state_dtype=state_dtype, **HYPER), plain_params, steps=1)
    for fused, plain in zip(fused_params, plain_params, strict=True):
        ulp = torch.finfo(torch.bfloat16).eps * plain.detach().float().abs()
        assert torch.all((fused.detach().float() - plain.detach().float()).abs() <= ulp * 1.0001)


def test_a_resumed_run_gives_the_uninterrupted_bits_and_keeps_float32_moments():
    """bf16 parameters with float32 moments: `Optimizer.load_state_dict` casts state to the parameter's dtype, which
    lost the moments' low bits on every resume before StochasticAdamW undid it."""

    def run(resume_at=None):
        params, groups = _model_params(_mixed_dtypes)
        optimizer = StochasticAdamW(groups, fused=True, seed=9, **HYPER)
        if resume_at is None:
            _train(optimizer, params, steps=5)
            return params, optimizer
        _train(optimizer, params, steps=resume_at)
        saved = copy.deepcopy(optimizer.state_dict())
        resumed, groups = _model_params(_mixed_dtypes)  # a new process: fresh parameters, loaded from the run's
        with torch.no_grad():
            for new, old in zip(resumed, params, strict=True):
                new.copy_(old)
        optimizer = StochasticAdamW(groups, fused=True, seed=0, **HYPER)  # another seed: the state dict's wins
        optimizer.load_state_dict(saved)
        _train(optimizer, resumed, steps=5 - resume_at, first=resume_at)
        return resumed, optimizer

    (straight, straight_optimizer), (resumed, resumed_optimizer) = run(), run(resume_at=2)
    for number, (want, got) in enumerate(zip(straight, resumed, strict=True)):
        _assert_same_bits(got, want, f"parameter {number}")
        for key in ("exp_avg", "exp_avg_sq"):
            assert resumed_optimizer.state[got][key].dtype == torch.float32
            _assert_same_bits(resumed_optimizer.state[got][key], straight_optimizer.state[want][key], key)


class _Holder(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.weight = torch.nn.Parameter(value)


@pytest.mark.distributed(world_size=2, timeout=180)
def test_fsdp_sharded_params_update_bitwise_like_the_per_tensor_loop():
    """FSDP2 shards dim 0 unevenly: (7, 33) as 4 + 3 rows, (1,) as 1 + 0 elements (an empty local shard)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    results = []
    for multi_tensor in (False, True):
        register_triton_stochastic_adamw(multi_tensor=multi_tensor)
        modules = [
            _Holder(randn(*shape, seed=number, dtype=_mixed_dtypes(number))) for number, shape in enumerate(SHAPES)
        ]
        for module in modules:
            fully_shard(module, mesh=mesh)
        params = [module.weight for module in modules]
        assert all(isinstance(param, DTensor) and param.placements == (Shard(0),) for param in params)
        optimizer = StochasticAdamW(params, fused=True, seed=3, **HYPER)
        for step in range(3):
            for number, param in enumerate(params):
                full = randn(*param.shape, seed=1000 + 10 * step + number, dtype=param.dtype)
                param.grad = distribute_tensor(full, mesh, [Shard(0)])
            optimizer.step()
        results.append(params)
    for number, (want, got) in enumerate(zip(*results, strict=True)):
        _assert_same_bits(got, want, f"rank {dist.get_rank()}'s shard of parameter {number}")
    assert results[1][1].to_local().numel() == (1 if dist.get_rank() == 0 else 0)
