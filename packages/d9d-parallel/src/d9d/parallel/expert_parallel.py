"""Expert parallelism for stacked expert parameters: `Shard(0)` over `ep`, then FSDP over what the fold leaves.

The expert domain `(pp, ep_replicate, ep, tp)` regroups the data and context ranks (see `d9d.core.dist.domains`).
Every parameter of an experts module is stacked `(E, ...)`; each of the `ep` ranks of a group keeps `E / ep`
consecutive experts, and FSDP shards those again over `ep_replicate` (and sums their gradients there). Under tensor
parallelism experts are not tensor-parallel (etp=1): each `tp` rank routes its own sequence shard within its EP group,
so the `tp` ranks are extra data ranks of the experts and FSDP runs over `ep_replicate x tp` (`expert_shard_mesh`,
docs/design/0021). The token exchange that goes with it is d9d-kernels' expert dispatch; this module only places
parameters.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_tensor

from d9d.core.dist import MeshDegrees
from d9d.core.dist.degrees import divisors
from d9d.parallel.compute_dtype import cast_parameters_in_forward
from d9d.parallel.fully_sharded import parallelize_fsdp
from d9d.parallel.mixed_precision import MixedPrecision
from d9d.parallel.placed import mark_placed

EXPERT_PARALLEL = "expert parallelism"


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


EXPERT_SHARD_WITH_TP = "ep_replicate_tp"


def expert_shard_mesh(expert_mesh: DeviceMesh) -> tuple[DeviceMesh, str]:
    """The 2-D `(<shard dim>, ep)` mesh `shard_experts` takes, and the name of its shard dimension.

    `expert_mesh` is `ctx.mesh_for('expert')` (`pp, ep_replicate, ep, tp`). Without tensor parallelism the shard
    dimension is `ep_replicate`; with `tp > 1` it is `ep_replicate` and `tp` flattened (`ep_replicate_tp`): experts
    are not tensor-parallel, each `tp` rank feeds them a different sequence shard, so their gradients are summed over
    the `tp` ranks as over data ranks.

    Raises:
        ValueError: the mesh lacks one of the expert domain's dimensions.
    """
    names = expert_mesh.mesh_dim_names or ()
    missing = [name for name in ("ep_replicate", "ep", "tp") if name not in names]
    if missing:
        raise ValueError(f"the mesh lacks dimensions {missing}; it has {names} (pass ctx.mesh_for('expert'))")
    if expert_mesh["tp"].size() == 1:
        return expert_mesh["ep_replicate", "ep"], "ep_replicate"
    flat = expert_mesh["ep_replicate", "tp"]._flatten(EXPERT_SHARD_WITH_TP)  # private, as in fold_tp_into_shard
    if hasattr(DeviceMesh, "_concatenate"):  # torch >= 2.12: slicing a flattened dimension from the root is deprecated
        return DeviceMesh._concatenate([flat, expert_mesh["ep"]]), EXPERT_SHARD_WITH_TP
    return expert_mesh[EXPERT_SHARD_WITH_TP, "ep"], EXPERT_SHARD_WITH_TP


def shard_experts(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    num_experts: int,
    ep_dim: str = "ep",
    shard_dim: str = "ep_replicate",
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> FSDPModule | None:
    """Split every parameter of `module` along dimension 0 over `mesh[ep_dim]`, then FSDP over `mesh[shard_dim]`.

    Call it on a meta-device module before `materialize_` (or on a real one: rank 0's values are scattered). Every
    parameter, adapters included, must be stacked by expert (`shape[0] == num_experts`). With `mesh[shard_dim]` of
    more than one rank (or `offload`) parameters end as DTensors on the 2-D `(shard_dim, ep_dim)` mesh, the module is
    its own FSDP unit (returned) and gradients are sums (see `use_sum_reduction`). With one rank there (efsdp = 1)
    they end as `Shard(0)` DTensors on `mesh[ep_dim]` with no FSDP unit (None is returned): each rank owns its
    experts' gradients whole already, so there is nothing to reduce; forward runs on `mixed_precision.param_dtype`
    copies and the parameters are marked placed, so an enclosing FSDP unit on another mesh leaves them alone.
    `offload`: keep the expert shards, their gradients and optimizer state in CPU memory (`d9d.parallel.offload`).

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
    if mesh[shard_dim].size() == 1 and not offload:
        for name, _ in module.named_parameters():
            owner_name, _, attribute = name.rpartition(".")
            mark_placed(module.get_submodule(owner_name), attribute, EXPERT_PARALLEL)
        cast_parameters_in_forward(module, mixed_precision.param_dtype if mixed_precision else None)
        return None
    return parallelize_fsdp(
        module,
        mesh[shard_dim],
        mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
        offload=offload,
    )
