"""AdamW for bfloat16 parameters with stochastic rounding: the plain-PyTorch reference implementation.

Each step upcasts a parameter (and its moment estimates, if stored in bfloat16) to float32, applies exactly
PyTorch's AdamW update (decoupled weight decay, bias correction, same operation order), and writes the results
back with stochastic rounding (`stochastic_rounding`), so bfloat16 weights follow the float32 trajectory in
expectation without a float32 master copy. Float32 parameters are updated like `torch.optim.AdamW`.

Randomness is counter-based: the noise for a parameter at a step comes from a generator seeded by (seed, step
counter, parameter index, the parameter's coordinates on the mesh dimensions it is sharded over). Replicas of a
parameter therefore round identically and stay bit-equal, shards draw independent noise, and the optimizer's RNG
state is just `(seed, counter)`, saved in its state dict under 'rng'. Parameters may be DTensors: the update runs
on local shards and never communicates. With `fused=True` the registered `FusedStochasticAdamWStep` (see
`fused_step`) does the arithmetic and the rounding in one kernel, with the same per-tensor seeds; when a
`FusedStochasticAdamWMultiStep` is registered too, one call updates each bucket of parameters that share a group,
a step count, dtypes and a device (one kernel launch for the whole model instead of one per parameter).

The host work per step is kept to a few microseconds per parameter, because with hundreds of parameters it used to
exceed the update itself: each parameter's shard coordinate is computed once, step counts are tracked as Python
ints beside the `state["step"]` tensors (still advanced every step, for checkpoints, but through a NumPy view
rather than a dispatched op), and one hash per parameter gives its three seeds.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from d9d.core.optim.fused_step import (
    AdamWStepParameters,
    registered_fused_stochastic_adamw_multi_step,
    registered_fused_stochastic_adamw_step,
)
from d9d.core.optim.stochastic_rounding import copy_stochastic_

_PARAM, _EXP_AVG, _EXP_AVG_SQ = 0, 1, 2
_SEED_MASK = 2**63 - 1
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(slots=True)
class _Update:
    """One parameter's update at this step: its local tensors, its step count and its seeds."""

    param: torch.Tensor  # local
    grad: torch.Tensor  # local
    exp_avg: torch.Tensor  # local
    exp_avg_sq: torch.Tensor  # local
    group: int
    step: int
    seeds: tuple[int, int, int]


@dataclass(slots=True)
class _StepCounter:
    """A parameter's step count as an int, and the `state["step"]` tensor it mirrors (with a view to write it)."""

    tensor: torch.Tensor
    view: np.ndarray[Any, Any] | None
    count: int


class StochasticAdamW(Optimizer):
    """AdamW whose bfloat16 parameters and (optionally bfloat16) moments are rounded stochastically.

    Args:
        params: parameters or parameter groups (bfloat16 or float32; plain tensors or DTensors).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW`.
        seed: seed of the rounding noise; use the same on every rank.
        state_dtype: dtype of the moment estimates; float32 (default) or bfloat16 (stochastically rounded too).
        fused: run the registered fused step (`register_fused_stochastic_adamw_step`, and the multi-tensor step of
            `register_fused_stochastic_adamw_multi_step` when one is registered) instead of PyTorch ops; the same
            update, but its rounding noise comes from the kernel's generator, not `torch.Generator`.
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
        fused: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must not be negative, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.fused_step = registered_fused_stochastic_adamw_step() if fused else None
        self.fused_multi_step = registered_fused_stochastic_adamw_multi_step() if fused else None
        self.seed = seed
        self.rng_counter = 0
        # Host-side caches, keyed by parameter: its shard coordinate (fixed for its life) and its step count as an
        # int beside the `state["step"]` tensor it mirrors (a replaced tensor, as after load_state_dict, is re-read).
        self._shards: dict[torch.Tensor, tuple[int, ...]] = {}
        self._steps: dict[torch.Tensor, _StepCounter] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = self._advance()
        if self.fused_multi_step is not None:
            self._step_buckets(updates)
        elif self.fused_step is not None:
            for update in updates:
                self.fused_step(
                    update.param, update.grad, update.exp_avg, update.exp_avg_sq,
                    hyper=self._hyper(update.group, update.step), seeds=update.seeds,
                )  # fmt: skip
        else:
            for update in updates:
                self._step_reference(update)
        self.rng_counter += 1
        return loss

    def _advance(self) -> list[_Update]:
        """Every parameter with a gradient, its state created if new and its step count advanced by one."""
        hasher = hashlib.blake2b(struct.pack("<qq", self.seed, self.rng_counter), digest_size=24)
        updates = []
        index = 0
        for group_index, group in enumerate(self.param_groups):
            for param in group["params"]:
                grad = param.grad
                if grad is not None:
                    state = self.state[param]
                    if not state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                        state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                    updates.append(
                        _Update(
                            param=_local(param), grad=_local(grad),
                            exp_avg=_local(state["exp_avg"]), exp_avg_sq=_local(state["exp_avg_sq"]),
                            group=group_index, step=self._advance_step(param, state["step"]),
                            seeds=self._seeds(hasher, index, self._shard(param)),
                        )
                    )  # fmt: skip
                index += 1
        return updates

    def _advance_step(self, param: torch.Tensor, step: torch.Tensor) -> int:
        """Add one to `param`'s `state["step"]` and return it as an int, without a tensor op or a read-back when
        the cache knows the tensor (a float32 CPU scalar, written through a NumPy view of its memory: 1% of the
        cost of a dispatched `add_`, which was most of the step's host time with hundreds of parameters)."""
        counter = self._steps.get(param)
        if counter is None or counter.tensor is not step:
            writable = type(step) is torch.Tensor and step.device.type == "cpu" and not step.requires_grad
            view = step.numpy() if writable else None  # else (a subclass, a device tensor) a dispatched fill_
            counter = self._steps[param] = _StepCounter(tensor=step, view=view, count=int(step.item()))
        counter.count += 1
        if counter.view is not None:
            counter.view[()] = counter.count
        else:
            step.fill_(counter.count)
        return counter.count

    def _shard(self, param: torch.Tensor) -> tuple[int, ...]:
        shard = self._shards.get(param)
        if shard is None:
            shard = self._shards[param] = _shard_coordinate(param)
        return shard

    @staticmethod
    def _seeds(step_hasher: Any, index: int, shard: tuple[int, ...]) -> tuple[int, int, int]:
        """Three 63-bit seeds (param, exp_avg, exp_avg_sq) from one hash of (seed, counter, index, shard)."""
        hasher = step_hasher.copy()
        hasher.update(repr((index, shard)).encode())
        param, exp_avg, exp_avg_sq = struct.unpack("<3Q", hasher.digest())
        return param & _SEED_MASK, exp_avg & _SEED_MASK, exp_avg_sq & _SEED_MASK

    def _hyper(self, group_index: int, step: int) -> AdamWStepParameters:
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return AdamWStepParameters(
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step
        )

    def _step_buckets(self, updates: list[_Update]) -> None:
        """One multi-tensor call per (group, step count, param/grad/moment dtypes, device)."""
        assert self.fused_multi_step is not None
        buckets: dict[tuple[Any, ...], list[_Update]] = {}
        for update in updates:
            key = (update.group, update.step, update.param.dtype, update.grad.dtype, update.exp_avg.dtype)
            buckets.setdefault((*key, update.param.device), []).append(update)
        for (group_index, step, *_), bucket in buckets.items():
            self.fused_multi_step(
                [update.param for update in bucket],
                [update.grad for update in bucket],
                [update.exp_avg for update in bucket],
                [update.exp_avg_sq for update in bucket],
                hyper=self._hyper(group_index, step),
                seeds=[update.seeds for update in bucket],
            )

    def _step_reference(self, update: _Update) -> None:
        hyper = self._hyper(update.group, update.step)
        lr, beta1, beta2, eps, weight_decay = hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay
        grad = update.grad.float()
        value = update.param.float()
        exp_avg, exp_avg_sq = update.exp_avg.float(), update.exp_avg_sq.float()

        value.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**hyper.step
        bias_correction2_sqrt = (1 - beta2**hyper.step) ** 0.5  # as torch.optim.AdamW computes it, bit for bit
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        value.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

        for slot, target, result in (
            (_PARAM, update.param, value),
            (_EXP_AVG, update.exp_avg, exp_avg),
            (_EXP_AVG_SQ, update.exp_avg_sq, exp_avg_sq),
        ):
            if target.data_ptr() != result.data_ptr():  # float32 slots were updated in place already
                generator = torch.Generator(device=target.device).manual_seed(update.seeds[slot])
                copy_stochastic_(target, result, generator=generator)

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
        self._restore_moment_dtype(state_dict)
        self.seed, self.rng_counter = int(rng["seed"]), int(rng["counter"])
        self._steps.clear()

    def _restore_moment_dtype(self, state_dict: dict[str, Any]) -> None:
        """Undo `Optimizer.load_state_dict`'s cast of every floating state to its parameter's dtype: it turned the
        float32 moments of bfloat16 parameters into bfloat16, losing their low bits on every resume."""
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            state = self.state[param]
            for key in _MOMENTS:
                if key in saved and state[key].dtype != self.state_dtype:  # from the saved tensor, not the cast
                    state[key] = saved[key].to(device=state[key].device, dtype=self.state_dtype)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # `_local_tensor`, not `to_local()`: the latter wraps a parameter's shard in a fresh view on every call.
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


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
