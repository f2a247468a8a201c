# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernel bodies are untyped by design: pointers and constexpr block sizes.)
"""Triton fused AdamW step with stochastic rounding to bfloat16: one pass over param, grad and both moments.

The arithmetic is torch.optim.AdamW's, operation for operation, in float32 (decoupled weight decay, `lerp` for the
first moment, `sqrt(v) / sqrt(1 - beta2^t) + eps`). A bfloat16 output adds 16 random bits (Philox, from the slot's
seed and the element index) to the float32 bit pattern and truncates (see d9d.core.optim.stochastic_rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.core.optim import AdamWStepParameters
from d9d.kernels.triton_support.tuning import autotune

_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
]


@triton.jit
def _store_rounded(ptr, offsets, value, mask, seed, STOCHASTIC: tl.constexpr):
    if STOCHASTIC:
        noise = (tl.randint(seed, offsets) & 0xFFFF).to(tl.int32, bitcast=True)
        bits = (value.to(tl.int32, bitcast=True) + noise) & -65536  # keep the high half: a bfloat16 exactly
        value = bits.to(tl.float32, bitcast=True)
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_update(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, mask,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
    seed_param, seed_exp_avg, seed_exp_avg_sq,
    PARAM_BF16: tl.constexpr, STATE_BF16: tl.constexpr,
):  # fmt: skip
    """The update of the elements at `offsets` of one tensor: shared by both kernels, so they give the same bits."""
    param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    param = param * decay
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - step_size * (exp_avg / denom)
    _store_rounded(param_ptr, offsets, param, mask, seed_param, PARAM_BF16)
    _store_rounded(exp_avg_ptr, offsets, exp_avg, mask, seed_exp_avg, STATE_BF16)
    _store_rounded(exp_avg_sq_ptr, offsets, exp_avg_sq, mask, seed_exp_avg_sq, STATE_BF16)


# In place on three tensors: the tuner restores them between its timing runs, so the first step is applied once.
@autotune(_CONFIGS, key=["n_elements"], restore_value=["param_ptr", "exp_avg_ptr", "exp_avg_sq_ptr"])
@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n_elements,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
    seed_param, seed_exp_avg, seed_exp_avg_sq,
    PARAM_BF16: tl.constexpr, STATE_BF16: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _adamw_update(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, offsets < n_elements,
        decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
        seed_param, seed_exp_avg, seed_exp_avg_sq, PARAM_BF16, STATE_BF16,
    )  # fmt: skip


def seed32(seed: int) -> int:
    """Philox takes a 32-bit seed; the optimizer's 63-bit per-slot seeds fold into one (xor of the halves)."""
    return (seed ^ (seed >> 32)) & 0x7FFFFFFF


def stochastic_adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    hyper: AdamWStepParameters,
    seeds: tuple[int, int, int],
) -> None:
    for tensor in (param, grad, exp_avg, exp_avg_sq):
        if not tensor.is_contiguous() or tensor.shape != param.shape:
            raise ValueError(
                f"the fused AdamW step needs contiguous tensors of one shape; got {tuple(tensor.shape)} "
                f"(contiguous={tensor.is_contiguous()}) for a parameter of {tuple(param.shape)}"
            )
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"both moments must share a dtype, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    n_elements = param.numel()
    if n_elements == 0:
        return

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(n_elements, meta["BLOCK"]),)

    _adamw_kernel[grid](
        param, grad, exp_avg, exp_avg_sq, n_elements, *kernel_scalars(hyper),
        *(seed32(seed) for seed in seeds),
        PARAM_BF16=param.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16,
    )  # fmt: skip


def kernel_scalars(hyper: AdamWStepParameters) -> tuple[float, ...]:
    """(decay, 1 - beta1, beta2, 1 - beta2, eps, step size, sqrt(1 - beta2^t)): the kernels' hyperparameters.

    Every scalar that combines hyperparameters is computed here in float64, as PyTorch's AdamW does, and reaches the
    kernel rounded once to float32: `1 - beta2` taken in float32 inside the kernel is 1.3e-5 off for 0.999, which
    moved results that cancel (a parameter near lr) by two bfloat16 steps on the GPU."""
    return (
        1 - hyper.lr * hyper.weight_decay, 1 - hyper.beta1, hyper.beta2, 1 - hyper.beta2, hyper.eps,
        hyper.lr / (1 - hyper.beta1**hyper.step), (1 - hyper.beta2**hyper.step) ** 0.5,
    )  # fmt: skip


# The multi-tensor step's table: one int64 row per tensor of the bucket, in this order (seeds already 32-bit).
TABLE_COLUMNS = ("param address", "grad address", "exp_avg address", "exp_avg_sq address", "numel", "seed param",
                 "seed exp_avg", "seed exp_avg_sq")  # fmt: skip


@triton.jit
def _typed_pointer(address, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    pointer = address.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        # Every address of the launch is a multiple of 16 bytes: 128-bit accesses, as the per-tensor kernel gets from
        # Triton's divisibility specialisation of pointer arguments. The hint must sit on the pointer, not the int.
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _adamw_multi_kernel(
    table_ptr, block_map_ptr,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, STATE_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK elements of one tensor of the bucket: `block_map` says which tensor and which block of
    it, the table row of that tensor its addresses, size and seeds. Offsets count within the tensor, so the noise is
    the per-tensor kernel's for the same seed."""
    tensor = tl.load(block_map_ptr + 2 * tl.program_id(0))
    block = tl.load(block_map_ptr + 2 * tl.program_id(0) + 1)
    row = table_ptr + tensor.to(tl.int64) * 8  # len(TABLE_COLUMNS)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    n_elements = tl.load(row + 4)
    if ALIGNED:  # and every element count a multiple of 16: the mask is constant over each 128-bit access
        n_elements = tl.multiple_of(n_elements, 16)
    _adamw_update(
        _typed_pointer(tl.load(row + 0), PARAM_DTYPE, ALIGNED),
        _typed_pointer(tl.load(row + 1), GRAD_DTYPE, ALIGNED),
        _typed_pointer(tl.load(row + 2), STATE_DTYPE, ALIGNED),
        _typed_pointer(tl.load(row + 3), STATE_DTYPE, ALIGNED),
        offsets, offsets < n_elements,
        decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
        tl.load(row + 5).to(tl.int32), tl.load(row + 6).to(tl.int32), tl.load(row + 7).to(tl.int32),
        PARAM_DTYPE == tl.bfloat16, STATE_DTYPE == tl.bfloat16,  # noqa: SIM300 - folded by Triton: constexpr first
    )  # fmt: skip


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def triton_dtype(dtype: torch.dtype, role: str) -> tl.dtype:
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"the multi-tensor AdamW step takes float32, bfloat16 or float16 {role}, got {dtype}")
    return _TRITON_DTYPES[dtype]


def launch_multi(
    table: torch.Tensor,
    block_map: torch.Tensor,
    hyper: AdamWStepParameters,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    *,
    aligned: bool,
    block: int,
    num_warps: int,
) -> None:
    """One launch of the multi-tensor kernel over `block_map`'s blocks (see d9d.kernels.adamw.multi_tensor)."""
    param_dtype, grad_dtype, state_dtype = dtypes
    _adamw_multi_kernel[(block_map.shape[0],)](
        table, block_map, *kernel_scalars(hyper),
        PARAM_DTYPE=triton_dtype(param_dtype, "parameters"), GRAD_DTYPE=triton_dtype(grad_dtype, "gradients"),
        STATE_DTYPE=triton_dtype(state_dtype, "moments"), ALIGNED=aligned, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
