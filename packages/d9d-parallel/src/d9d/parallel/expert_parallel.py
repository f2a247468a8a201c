"""Expert parallelism for stacked expert parameters: `Shard(0)` over `ep`, then FSDP over what the fold leaves.

The expert domain `(pp, ep_replicate, ep, tp)` regroups the data and context ranks (see `d9d.core.dist.domains`).
Every parameter of an experts module is stacked `(E, ...)`; each of the `ep` ranks of a group keeps `E / ep`
consecutive experts, and FSDP shards those again over `ep_replicate` (and sums their gradients there). The token
exchange that goes with it is d9d-kernels' expert dispatch; this module only places parameters.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_tensor

from d9d.core.dist import MeshDegrees
from d9d.core.dist.degrees import divisors
from d9d.parallel.fully_sharded import parallelize_fsdp
from d9d.parallel.mixed_precision import MixedPrecision


def check_expert_parallel_degrees(degrees: MeshDegrees, num_experts: int) -> None:
    """Refuse an `ep` that cannot split `num_experts` or the `dp_replicate * dp_shard * cp` ranks it folds over.

    Works on unresolved degrees too (`dp_shard=-1` skips the fold check, which `MeshDegrees.resolve` repeats), so a
    launcher can call it before starting ranks.

    Raises:
        ValueError: naming the degree, the value and the valid ones.
    """
    if num_experts % degrees.ep != 0:
        raise ValueError(
            f"ep={degrees.ep} must divide num_experts={num_experts} (each expert-parallel rank holds "
            f"num_experts/ep experts); valid ep values: {', '.join(map(str, divisors(num_experts)))}."
        )
    if degrees.is_resolved and degrees.expert_fold % degrees.ep != 0:
        fold = degrees.expert_fold
        valid = [d for d in divisors(fold) if num_experts % d == 0]
        raise ValueError(
            f"ep={degrees.ep} must divide dp_replicate*dp_shard*cp = {fold} ({degrees.describe()}); valid ep "
            f"values for {num_experts} experts: {', '.join(map(str, valid))}."
        )


def shard_experts(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    num_experts: int,
    ep_dim: str = "ep",
    shard_dim: str = "ep_replicate",
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
) -> FSDPModule:
    """Split every parameter of `module` along dimension 0 over `mesh[ep_dim]`, then FSDP over `mesh[shard_dim]`.

    Call it on a meta-device module before `materialize_` (or on a real one: rank 0's values are scattered). Every
    parameter, adapters included, must be stacked by expert (`shape[0] == num_experts`). Parameters end as DTensors
    on the 2-D `(shard_dim, ep_dim)` mesh; gradients are sums (see `use_sum_reduction`). The module becomes its own
    FSDP unit even when `mesh[shard_dim]` has one rank, so an enclosing FSDP unit on another mesh leaves it alone.

    Raises:
        ValueError: a parameter not stacked by expert, or `num_experts` not divisible by the `ep_dim` size.
    """
    ep_mesh = mesh[ep_dim]
    if num_experts % ep_mesh.size() != 0:
        raise ValueError(f"num_experts={num_experts} is not divisible by {ep_dim}={ep_mesh.size()}")
    for name, param in list(module.named_parameters()):
        if param.ndim == 0 or param.shape[0] != num_experts:
            raise ValueError(
                f"expert parallelism splits parameters by expert, but {name!r} has shape {list(param.shape)} "
                f"(expected a first dimension of num_experts={num_experts})"
            )
        owner_name, _, attribute = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
        setattr(owner, attribute, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return parallelize_fsdp(
        module, mesh[shard_dim], mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward
    )
