"""Meshes derived from the dense mesh for modules that treat the `tp` ranks as extra data-parallel ranks."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


def fold_tp_into_shard(dense_mesh: DeviceMesh, *, shard_dim: str = "dp_cp_shard", tp_dim: str = "tp") -> DeviceMesh:
    """The 2-D `(dp_replicate, <shard_dim>_<tp_dim>)` mesh: `shard_dim` and `tp_dim` flattened into one dimension.

    For blocks that run on a rank's sequence shard with parameters that are not tensor-parallel (an MoE block under
    tp without ep): FSDP over the flattened dimension shards them over, and sums their gradients across, both.
    """
    names = dense_mesh.mesh_dim_names or ()
    missing = [name for name in ("dp_replicate", shard_dim, tp_dim) if name not in names]
    if missing:
        raise ValueError(f"the mesh lacks dimensions {missing}; it has {names} (pass ctx.mesh_for('dense'))")
    flat_name = f"{shard_dim}_{tp_dim}"
    flat = dense_mesh[shard_dim, tp_dim]._flatten(flat_name)  # private but what FSDP+EP users rely on
    if hasattr(DeviceMesh, "_concatenate"):  # torch >= 2.12: slicing a flattened dimension from the root is deprecated
        return DeviceMesh._concatenate([dense_mesh["dp_replicate"], flat])
    return dense_mesh["dp_replicate", flat_name]
