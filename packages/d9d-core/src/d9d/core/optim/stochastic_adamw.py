"""AdamW for bfloat16 parameters with stochastic rounding: the plain-PyTorch reference implementation.

Each step upcasts a parameter (and its moment estimates, if stored in bfloat16) to float32, applies exactly
PyTorch's AdamW update (decoupled weight decay, bias correction, same operation order), and writes the results
back with stochastic rounding (`stochastic_rounding`), so bfloat16 weights follow the float32 trajectory in
expectation without a float32 master copy. Float32 parameters are updated like `torch.optim.AdamW`.

Randomness is counter-based: the noise for a parameter at a step comes from a generator seeded by (seed, step
counter, parameter index, the parameter's coordinates on the mesh dimensions it is sharded over). Replicas of a
parameter therefore round identically and stay bit-equal, shards draw independent noise, and the optimizer's RNG
state is just `(seed, counter)`, saved in its state dict under 'rng'. Parameters may be DTensors: the update runs
on local shards and never communicates. A fused kernel can replace `_update` later with the same contract.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from d9d.core.optim.stochastic_rounding import copy_stochastic_

_PARAM, _EXP_AVG, _EXP_AVG_SQ = 0, 1, 2


class StochasticAdamW(Optimizer):
    """AdamW whose bfloat16 parameters and (optionally bfloat16) moments are rounded stochastically.

    Args:
        params: parameters or parameter groups (bfloat16 or float32; plain tensors or DTensors).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW`.
        seed: seed of the rounding noise; use the same on every rank.
        state_dtype: dtype of the moment estimates; float32 (default) or bfloat16 (stochastically rounded too).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must not be negative, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.seed = seed
        self.rng_counter = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group, index)
                index += 1
        self.rng_counter += 1
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any], index: int) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]

        local_param = _local(param)
        grad = _local(param.grad).float()  # type: ignore[arg-type]
        exp_avg_slot, exp_avg_sq_slot = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        value = local_param.float()
        exp_avg, exp_avg_sq = exp_avg_slot.float(), exp_avg_sq_slot.float()

        value.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5  # as torch.optim.AdamW computes it, bit for bit
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        value.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

        shard = _shard_coordinate(param)
        for slot, target, result in (
            (_PARAM, local_param, value),
            (_EXP_AVG, exp_avg_slot, exp_avg),
            (_EXP_AVG_SQ, exp_avg_sq_slot, exp_avg_sq),
        ):
            if target.data_ptr() != result.data_ptr():  # float32 slots were updated in place already
                copy_stochastic_(target, result, generator=self._generator(index, slot, shard, target.device))

    def _generator(self, index: int, slot: int, shard: tuple[int, ...], device: torch.device) -> torch.Generator:
        key = repr((self.seed, self.rng_counter, index, slot, shard)).encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)
        return torch.Generator(device=device).manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rng"] = {"seed": self.seed, "counter": self.rng_counter}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rng = state_dict.pop("rng", None)
        if rng is None:
            raise KeyError("the state dict has no 'rng' entry: it was not saved by StochasticAdamW")
        super().load_state_dict(state_dict)
        self.seed, self.rng_counter = int(rng["seed"]), int(rng["counter"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_coordinate(param: torch.Tensor) -> tuple[int, ...]:
    """This rank's coordinates on the mesh dimensions `param` is sharded over (empty when fully replicated)."""
    if not isinstance(param, DTensor):
        return ()
    coordinate = tuple(param.device_mesh.get_coordinate() or ())
    # Not `isinstance(placement, Shard)`: FSDP over an expert-parallel dimension yields `_StridedShard`, no `Shard`.
    return tuple(
        coordinate[dim]
        for dim, placement in enumerate(param.placements)
        if not placement.is_replicate() and not placement.is_partial()
    )
