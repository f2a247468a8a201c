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
    mask = offsets < n_elements
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


def _seed32(seed: int) -> int:
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

    # Every scalar that combines hyperparameters is computed here in float64, as PyTorch's AdamW does, and reaches
    # the kernel rounded once to float32: `1 - beta2` taken in float32 inside the kernel is 1.3e-5 off for 0.999,
    # which moved results that cancel (a parameter near lr) by two bfloat16 steps on the GPU.
    _adamw_kernel[grid](
        param, grad, exp_avg, exp_avg_sq, n_elements,
        1 - hyper.lr * hyper.weight_decay, 1 - hyper.beta1, hyper.beta2, 1 - hyper.beta2, hyper.eps,
        hyper.lr / (1 - hyper.beta1**hyper.step), (1 - hyper.beta2**hyper.step) ** 0.5,
        *(_seed32(seed) for seed in seeds),
        PARAM_BF16=param.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16,
    )  # fmt: skip
