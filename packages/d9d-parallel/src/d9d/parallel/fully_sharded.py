"""FSDP and HSDP as functions on a module and a mesh, reducing gradients by sum.

Both wrap FSDP2's `fully_shard`. Gradients are reduced with a plain sum (no division by the number of ranks): the
caller divides the loss by the exact global token count, which is right whatever the data-parallel size, the number
of micro-batches or how tokens are spread over them. Replicate (`GradientSynchronizer`) reduces by sum as well.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

from d9d.parallel.mixed_precision import MixedPrecision
from d9d.parallel.offload import cpu_offload_policy, mark_cpu_offloaded
from d9d.parallel.placed import placed_parameters


def parallelize_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> FSDPModule:
    """Shard `module`'s parameters (those not already in an inner FSDP unit) over the 1-D `mesh`.

    Parameters become `Shard(0)` DTensors; forward all-gathers them (in `mixed_precision.param_dtype` if set) and
    backward reduce-scatters their gradients (in `mixed_precision.reduce_dtype`) as a sum. `offload`: keep the
    shards, their gradients and so the optimizer state in CPU memory (`d9d.parallel.offload`).

    Raises:
        ValueError: a mesh with more than one dimension (use `parallelize_hsdp`).
    """
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_fsdp needs a 1-D mesh, got dimensions {mesh.mesh_dim_names} of shape {tuple(mesh.shape)}; "
            "slice the shard dimension (mesh['dp_cp_shard']) or use parallelize_hsdp to replicate over the others."
        )
    return _fully_shard(module, mesh, mixed_precision, reshard_after_forward, offload)


def parallelize_hsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    shard_dim: str = "dp_cp_shard",
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> FSDPModule:
    """Replicate over every other dimension of `mesh` of size > 1, shard over `shard_dim`.

    Pass the data-parallel part of a mesh, e.g. `ctx.mesh_for('dense')['dp_replicate', 'dp_cp_shard']`.
    Parameters become DTensors with `Replicate` on the replicate dimension and `Shard(0)` on `shard_dim`; gradients
    are reduce-scattered over `shard_dim` and all-reduced over the replicate dimension, both as sums. With no
    replicate dimension of size > 1 this is `parallelize_fsdp` over `shard_dim`. `offload` as in `parallelize_fsdp`.

    Raises:
        ValueError: `shard_dim` is not a dimension of `mesh`, or more than one other dimension has size > 1
            (FSDP2 replicates over one dimension; flatten them into one first).
    """
    names = mesh.mesh_dim_names or ()
    if shard_dim not in names:
        raise ValueError(f"shard_dim={shard_dim!r} is not a dimension of the mesh; valid: {', '.join(names)}")
    replicate = [name for name in names if name != shard_dim and mesh[name].size() > 1]
    if not replicate:
        return _fully_shard(module, mesh[shard_dim], mixed_precision, reshard_after_forward, offload)
    if len(replicate) > 1:
        sizes = ", ".join(f"{name}={mesh[name].size()}" for name in replicate)
        raise ValueError(
            f"parallelize_hsdp replicates over one mesh dimension, but {len(replicate)} besides "
            f"shard_dim={shard_dim!r} have size > 1 ({sizes}); pass a mesh whose other dimensions are one "
            "flattened replicate dimension."
        )
    return _fully_shard(module, mesh[replicate[0], shard_dim], mixed_precision, reshard_after_forward, offload)


def _fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    mixed_precision: MixedPrecision | None,
    reshard_after_forward: bool,
    offload: bool,
) -> FSDPModule:
    policy = (mixed_precision or MixedPrecision()).to_fsdp()
    sharded = fully_shard(
        module,
        mesh=mesh,
        mp_policy=policy,
        reshard_after_forward=reshard_after_forward,
        offload_policy=cpu_offload_policy(mesh) if offload else OffloadPolicy(),
        # Parameters an earlier step placed on another mesh (experts at efsdp = 1) stay as they are.
        ignored_params=placed_parameters(module) or None,
    )
    assert isinstance(sharded, FSDPModule)
    use_sum_reduction(sharded)
    if offload:
        mark_cpu_offloaded(module)  # the same object as `sharded`, typed as a module
    return sharded


def use_sum_reduction(module: FSDPModule) -> None:
    """Reduce gradients by sum: no pre- or post-division by the number of data-parallel ranks."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
