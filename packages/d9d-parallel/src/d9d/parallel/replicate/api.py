"""`parallelize_replicate`: data parallelism by replicated DTensor parameters, without DistributedDataParallel."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils.hooks import RemovableHandle

from d9d.parallel.mixed_precision import MixedPrecision
from d9d.parallel.placed import placed_by
from d9d.parallel.replicate.marker import ReplicateInfo, mark_replicated
from d9d.parallel.replicate.to_local import LocalParameterScope, holders


@dataclass
class ReplicateHandle:
    """What `parallelize_replicate` did to a module: the parameters it distributed and its forward hooks."""

    parameters: list[nn.Parameter]
    hooks: list[RemovableHandle] = field(default_factory=list)

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def parallelize_replicate(
    module: nn.Module, mesh: DeviceMesh, *, mixed_precision: MixedPrecision | None = None
) -> ReplicateHandle:
    """Replicate every parameter of `module` over all dimensions of `mesh`, in place.

    Parameters become `Replicate` DTensors (broadcast from the mesh's first rank, so replicas start identical;
    parameters on the meta device are wrapped without communication, to be materialised later). Inside forward
    they are plain local tensors, converted where they are used (cast to `mixed_precision.param_dtype` if given,
    and floating inputs of `module` too), whose gradients come back as `Partial` sums (see `to_local`). Nothing is
    reduced here: build a `GradientSynchronizer.for_module(module)` to all-reduce the gradients in buckets,
    overlapped with backward. Parameters an earlier step placed on another mesh (`d9d.parallel.placed`: experts at
    efsdp = 1, whose gradients are whole on their expert-parallel rank) are left as they are and not reduced.

    Raises:
        ValueError: a parameter that is already a DTensor (replicate a module once, as a whole).
    """
    policy = mixed_precision or MixedPrecision()
    # Dimensions of size one hold a single replica: nothing to reduce there.
    reduce_dims = tuple(dim for dim in range(mesh.ndim) if mesh.size(dim) > 1)
    info = ReplicateInfo(reduce_dims=reduce_dims, compute_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    placements = [Replicate()] * mesh.ndim
    distributed: dict[int, nn.Parameter] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, param in list(owner._parameters.items()):
            if param is None or placed_by(owner, name) is not None:
                continue
            replacement = distributed.get(id(param))
            if replacement is None:
                if isinstance(param, DTensor):
                    qualified = f"{prefix}.{name}" if prefix else name
                    raise ValueError(
                        f"parameter {qualified!r} is already a DTensor on mesh {param.device_mesh} with placements "
                        f"{param.placements}; parallelize_replicate distributes plain parameters only; apply it once, "
                        "to the whole module."
                    )
                replacement = nn.Parameter(_replicate(param.detach(), mesh, placements), param.requires_grad)
                distributed[id(param)] = replacement
            owner._parameters[name] = replacement
            mark_replicated(owner, name, info)
    hooks = LocalParameterScope(cast_inputs_to=policy.param_dtype).attach(module)
    for submodule in module.modules():
        if submodule is not module and holders(submodule):
            hooks += LocalParameterScope(cast_inputs_to=None).attach(submodule)
    return ReplicateHandle(parameters=list(distributed.values()), hooks=hooks)


def _replicate(tensor: torch.Tensor, mesh: DeviceMesh, placements: list[Replicate]) -> DTensor:
    if tensor.is_meta:
        return DTensor.from_local(tensor, mesh, placements, run_check=False)
    return distribute_tensor(tensor, mesh, placements)
