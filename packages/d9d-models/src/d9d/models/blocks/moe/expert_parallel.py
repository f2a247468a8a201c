"""The expert-parallel plan step for any model with MoE layers (found by role): dispatcher + sharded experts.

Run it on the meta-device model before the data-parallel step: the experts become their own FSDP units on the
expert domain, or, where the expert domain has one data rank per `ep` group (efsdp = 1), plain `Shard(0)` parameters
marked placed (docs/design/0025); either way the enclosing units (decoder layers on the dense domain) leave their
parameters alone.
"""

from __future__ import annotations

from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.kernels.expert_dispatch import build_token_dispatcher
from d9d.models.blocks.moe.experts import GroupedSwiGLU
from d9d.models.blocks.moe.layer import MoELayer
from d9d.models.roles import Role
from d9d.parallel import (
    ByRole,
    MixedPrecision,
    check_expert_parallel_degrees,
    expert_shard_mesh,
    select_modules,
    shard_experts,
)


def parallelize_experts(
    model: nn.Module,
    ctx: DistributedContext,
    *,
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> list[MoELayer]:
    """Shard the experts of every MoE layer of `model` over the `ep` ranks and give each layer its dispatcher.

    Experts are `Shard(0)` over `expert['ep']` and FSDP-sharded over `expert['ep_replicate']` (with
    `mixed_precision`, like the dense parameters); with `tp > 1` over `ep_replicate x tp`, since each `tp` rank
    routes its own sequence shard (experts are not tensor-parallel, docs/design/0021). Each layer's
    `dispatch_config` picks the token exchange. Where that FSDP dimension has one rank (efsdp = 1) the experts get
    no FSDP unit (`shard_experts`): their gradients are whole on their rank already, and a unit would only add
    hooks, a float32 copy of every expert gradient and a wait on the previous unit's reduce-scatter in each layer's
    backward (docs/design/0025); forward runs on `mixed_precision.param_dtype` copies, held until backward, and
    `reshard_after_forward` does not apply. Returns the layers it changed.

    Raises:
        ValueError: `ep` does not divide a layer's expert count (or the data ranks it folds over).
        TypeError: a module declared the MoE role but is not an `MoELayer`.
    """
    mesh = ctx.mesh_for(MeshDomain.EXPERT)
    group = mesh["ep"].get_group()
    shard_mesh, shard_dim = expert_shard_mesh(mesh)
    layers: list[MoELayer] = []
    for name, module in select_modules(model, [ByRole(str(Role.MOE))]):
        if not isinstance(module, MoELayer) or not isinstance(module.experts, GroupedSwiGLU):
            raise TypeError(f"{name!r} declares the MoE role but is a {type(module).__name__}, not an MoELayer")
        check_expert_parallel_degrees(ctx.degrees, module.num_experts)
        module.dispatcher = build_token_dispatcher(module.dispatch_config, group=group, num_experts=module.num_experts)
        module.experts.use_local_shards()
        shard_experts(
            module.experts,
            shard_mesh,
            num_experts=module.num_experts,
            shard_dim=shard_dim,
            mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward,
            offload=offload,
        )
        layers.append(module)
    return layers
