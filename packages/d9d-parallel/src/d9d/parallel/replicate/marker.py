"""Which parameters `parallelize_replicate` owns, and how their gradients must be reduced.

The record lives on the module that holds the parameter (`{name: ReplicateInfo}`), not on the parameter: methods
such as `module.to_empty()` swap a DTensor parameter's contents and attributes with a new tensor in place (and
refuse tensors with weak references), while the module and the name stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

_ATTRIBUTE = "_d9d_replicated"


@dataclass(frozen=True, kw_only=True)
class ReplicateInfo:
    """How one replicated parameter is computed with and reduced.

    `reduce_dims` are the mesh dimensions (of size > 1) the parameter is replicated over: its gradient is a partial
    sum over them until it is all-reduced. `compute_dtype` is the dtype forward sees it in (`None`: its own);
    `reduce_dtype` the dtype to accumulate and reduce its gradient in (`None`: the parameter's dtype).
    """

    reduce_dims: tuple[int, ...]
    compute_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None


@dataclass(frozen=True, kw_only=True)
class ReplicatedParameter:
    name: str
    param: DTensor
    info: ReplicateInfo


def mark_replicated(owner: nn.Module, name: str, info: ReplicateInfo) -> None:
    owner.__dict__.setdefault(_ATTRIBUTE, {})[name] = info


def replicate_info(owner: nn.Module, name: str) -> ReplicateInfo | None:
    """The record of `owner`'s parameter `name`, if `parallelize_replicate` distributed it."""
    records: dict[str, ReplicateInfo] = owner.__dict__.get(_ATTRIBUTE, {})
    return records.get(name) if isinstance(owner._parameters.get(name), DTensor) else None


def managed_names(owner: nn.Module) -> frozenset[str]:
    """Names of `owner`'s own parameters that `parallelize_replicate` distributed."""
    return frozenset(name for name in owner.__dict__.get(_ATTRIBUTE, {}) if replicate_info(owner, name) is not None)


def replicated_parameters(module: nn.Module) -> list[ReplicatedParameter]:
    """Trainable parameters of `module` that `parallelize_replicate` distributed, each once, in module order."""
    found: dict[int, ReplicatedParameter] = {}
    for prefix, owner in module.named_modules():
        for name in managed_names(owner):
            param = owner._parameters[name]
            info = replicate_info(owner, name)
            if isinstance(param, DTensor) and info is not None and param.requires_grad and id(param) not in found:
                found[id(param)] = ReplicatedParameter(
                    name=f"{prefix}.{name}" if prefix else name, param=param, info=info
                )
    order = {id(param): index for index, param in enumerate(module.parameters())}
    return sorted(found.values(), key=lambda record: order[id(record.param)])


def accumulation_placements(param: DTensor, info: ReplicateInfo) -> tuple[Placement, ...]:
    """Placements of a gradient while it is accumulated: `Partial` (a per-rank partial sum) on the reduce dims."""
    return tuple(Partial() if dim in info.reduce_dims else placement for dim, placement in enumerate(param.placements))


def reduced_placements(param: DTensor, info: ReplicateInfo) -> tuple[Placement, ...]:
    """Placements of a gradient once reduced: the parameter's own (`Replicate` on the reduce dims)."""
    return tuple(
        Replicate() if dim in info.reduce_dims else placement for dim, placement in enumerate(param.placements)
    )
