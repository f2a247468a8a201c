"""Gradient norm and clipping that are exact on hybrid meshes.

A parameter's gradient is a DTensor whose placements say what each rank holds. The global norm^p is the sum over
parameters of the sum over their *distinct* elements of |g|^p. For each parameter this rank therefore adds up the
|g|^p of its local tensor, and those partial sums are all-reduced over exactly the mesh dimensions on which the
gradient is `Shard`ed: there the ranks hold disjoint pieces. Over `Replicate` dimensions every rank holds the same
values, so they are not reduced, and each element is counted once. Parameters are grouped by (mesh, shard
dimensions), one all-reduce per group and shard dimension; the group totals are then added, and finally summed
over `across` (the pipeline stages, which own disjoint parameters). The infinity norm uses max instead of sum.

A group's local sum takes one `torch._foreach_norm` per (device, dtype) of its gradients (a few multi-tensor
kernels instead of one reduction per parameter: 311 at the dense anchor), asked for float32 results, which makes it
accumulate in float32 whatever the gradients' dtype, as `vector_norm(..., dtype=torch.float32)` did per tensor. The
per-tensor norms are then raised to p and summed in float32. Everything runs under `no_grad`, where a DTensor's
`to_local()` is an attribute read rather than an autograd call.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

_GroupKey = tuple[DeviceMesh | None, tuple[int, ...]]


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *, across: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients of `parameters` taken together, identical on every rank (float32 scalar).

    Raises:
        ValueError: a gradient with a `Partial` placement (it has not been synchronised yet).
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    groups: dict[_GroupKey, list[torch.Tensor]] = {}
    device: torch.device | None = None
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key, local = _group_key_and_local(grad)
        groups.setdefault(key, []).append(local)
        device = device or local.device
    if device is None:
        return torch.zeros((), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, shard_dims), locals_ in groups.items():
        partial = _local_power_sum(locals_, norm_type).to(device)
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        for dim in shard_dims:
            assert mesh is not None
            dist.all_reduce(partial, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, partial) if is_inf else total + partial
    if across is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=across)
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    across: dist.ProcessGroup | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; returns the norm before clipping.

    Same contract as `torch.nn.utils.clip_grad_norm_` (scale `max_norm / (norm + 1e-6)`, only when below one),
    with the norm computed exactly across the mesh (see the module docstring). No communication beyond the norm.
    """
    params = [param for param in parameters if param.grad is not None]
    norm = total_grad_norm(params, norm_type, across=across)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total gradient norm of order {norm_type} is non-finite ({norm.item()})")
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        assert param.grad is not None
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), grads in by_device.items():
        torch._foreach_mul_(grads, coefficient.to(device))
    return norm


def _group_key_and_local(grad: torch.Tensor) -> tuple[_GroupKey, torch.Tensor]:
    if not isinstance(grad, DTensor):
        return (None, ()), grad
    if any(isinstance(placement, Partial) for placement in grad.placements):
        raise ValueError(
            f"a gradient of shape {list(grad.shape)} has placements {grad.placements}: a Partial gradient is not "
            "synchronised yet; wait for the gradient synchroniser before computing the norm."
        )
    shard_dims = tuple(dim for dim, placement in enumerate(grad.placements) if _is_split(placement))
    return (grad.device_mesh, shard_dims), grad.to_local()


def _is_split(placement: Placement) -> bool:
    # FSDP over a tensor-parallel parameter split on the same dimension uses `_StridedShard`, which is not a `Shard`
    # subclass (nor `is_shard()`) in recent torch, yet its ranks hold disjoint elements all the same.
    return isinstance(placement, Shard | _StridedShard)


def _local_power_sum(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """This rank's sum of |g|^p over `grads` (max |g| for the infinity norm), in float32 on `grads[0]`'s device."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel() > 0:  # a rank may hold an empty shard (FSDP pads uneven dimensions); it contributes nothing
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    device = grads[0].device
    partials = [_power_sum(same, norm_type).to(device) for same in by_kind.values()]
    if not partials:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(partials) == 1:
        return partials[0]
    stacked = torch.stack(partials)
    return stacked.max() if math.isinf(norm_type) else stacked.sum()


def _power_sum(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    # dtype=float32: the foreach kernel accumulates in float32 and returns float32 norms, also for bf16 gradients.
    norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32))
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()
