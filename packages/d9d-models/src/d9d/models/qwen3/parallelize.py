"""Parallel plans for the Qwen3 families: one sequence of steps over a stage's modules, one plan per family per step.

`parallelize_qwen3_dense` and `parallelize_qwen3_moe` run the same steps in this order:

1. tensor + sequence parallelism on the `tp` dimension of the dense mesh (`tensor_parallel.py`, a plan per family);
2. expert parallelism (Qwen3-MoE, `ep > 1`): experts sharded over the expert domain, tokens dispatched
   (`parallelize_experts`); context parallelism (`parallelize_context`) swaps a sequence-sharded attention into
   every attention layer before it (batches are sharded by `d9d.parallel.context`);
3. data parallelism (replicate, FSDP, HSDP) on `(dp_replicate, dp_cp_shard)`, last, because FSDP wraps the DTensors
   the earlier steps made.

Modules are found by the roles the models declare (`d9d.models.roles.Role`), never by class: with FSDP/HSDP each
decoder layer, the embedding and the LM head become their own units (unless the config names its own units), and the
rest (final norm) joins the root unit. A degree whose step is not implemented yet is refused up front rather than
silently trained as data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.models.blocks.context_parallel import parallelize_context
from d9d.models.blocks.moe import parallelize_experts
from d9d.models.qwen3.tensor_parallel import (
    TensorParallelConfig,
    TensorParallelPlan,
    apply_qwen3_tensor_parallel,
    expert_units_mesh,
    qwen3_dense_tp_plan,
    qwen3_moe_tp_plan,
)
from d9d.models.roles import Role
from d9d.parallel import (
    AnyDataParallelConfig,
    ByRole,
    FsdpConfig,
    GradientSync,
    GradientSyncs,
    HsdpConfig,
    ModuleGradientSync,
    ReplicateConfig,
    SingleDeviceConfig,
    build_data_parallel,
    parallelize_fsdp,
    parallelize_hsdp,
    select_modules,
)
from d9d.parallel.context import ContextParallelConfig
from d9d.parallel.placed import placed_parameters

DEFAULT_UNIT_ROLES = [str(Role.DECODER_LAYER), str(Role.EMBEDDING), str(Role.LM_HEAD)]


@dataclass(frozen=True)
class Qwen3FamilyPlan:
    """What differs between the families, step by step."""

    name: str
    tensor_parallel: Callable[[nn.Module], TensorParallelPlan]
    has_experts: bool = False


DENSE = Qwen3FamilyPlan(name="parallelize_qwen3_dense", tensor_parallel=qwen3_dense_tp_plan)
MOE = Qwen3FamilyPlan(name="parallelize_qwen3_moe", tensor_parallel=qwen3_moe_tp_plan, has_experts=True)


def parallelize_qwen3_dense(
    model: nn.Module,
    ctx: DistributedContext,
    config: AnyDataParallelConfig,
    *,
    tensor_parallel: TensorParallelConfig | None = None,
    context: ContextParallelConfig | None = None,
) -> GradientSync:
    """Apply the topology of `ctx` and `config` to a (stage of a) Qwen3 dense model built on the meta device, before
    `materialize_`. Returns what the training loop drives per step (`begin_step`, `wait`).

    Raises:
        ValueError: the model's shapes do not divide by `tp`, or `kind='replicate'` with `tp > 1`.
        NotImplementedError: the topology has ep above 1.
    """
    return _parallelize(model, ctx, config, DENSE, tensor_parallel or TensorParallelConfig(), context=context)


def parallelize_qwen3_moe(
    model: nn.Module,
    ctx: DistributedContext,
    config: AnyDataParallelConfig,
    *,
    tensor_parallel: TensorParallelConfig | None = None,
    context: ContextParallelConfig | None = None,
) -> GradientSync:
    """Like `parallelize_qwen3_dense`. With `ep == 1` experts are data-parallel parameters (sharded along the expert
    dimension under FSDP); with `tp > 1` each MoE block routes its rank's sequence shard and is sharded over
    `dp_cp_shard x tp` (docs/design/0005); with `ep > 1` experts are expert-parallel (`parallelize_experts`, the data
    config's mixed precision; docs/design/0007) and the dense parameters then get `config`. `ep` with `tp` keeps
    attention and the dense layers tensor- and sequence-parallel and the experts whole (etp=1), sharded over `ep`
    and FSDP over `ep_replicate x tp` (docs/design/0021).

    Raises:
        ValueError: the model's shapes do not divide by `tp`, `kind='replicate'` with `tp > 1` or with experts
            shared by several ranks (`ep` below `dp_replicate * dp_shard * cp`), or an `ep` that does not divide the
            experts.
    """
    return _parallelize(model, ctx, config, MOE, tensor_parallel or TensorParallelConfig(), context=context)


def _parallelize(
    model: nn.Module,
    ctx: DistributedContext,
    config: AnyDataParallelConfig,
    family: Qwen3FamilyPlan,
    tensor_parallel: TensorParallelConfig,
    *,
    context: ContextParallelConfig | None,
) -> GradientSync:
    _refuse_unsupported(ctx, family)
    tp = ctx.degrees.tp
    if tp > 1:
        if isinstance(config, ReplicateConfig | SingleDeviceConfig):
            raise ValueError(
                f"{family.name}: kind={config.kind!r} with tp={tp} is not supported: FSDP reduces the tensor-parallel "
                "gradients of the replicated (norm) parameters; use kind='fsdp' (with dp_shard=1 it is tp alone) "
                "or kind='hsdp'."
            )
        apply_qwen3_tensor_parallel(
            model, ctx.mesh_for(MeshDomain.DENSE)["tp"], family.tensor_parallel(model), tensor_parallel
        )
    parallelize_context(model, ctx, context)
    if ctx.degrees.ep > 1 and tp > 1 and not tensor_parallel.sequence_parallel:
        raise NotImplementedError(
            f"{family.name}: ep={ctx.degrees.ep} with tp={tp} and sequence_parallel=False (the inference layout) is "
            "not supported yet: no parity test covers expert dispatch of replicated activations; generate or score "
            "with ep=1 or tp=1"
        )
    if ctx.degrees.ep > 1:
        _expert_parallel(model, ctx, config, family)
    return _data_parallel(model, ctx, config)


def _expert_parallel(
    model: nn.Module, ctx: DistributedContext, config: AnyDataParallelConfig, family: Qwen3FamilyPlan
) -> None:
    """Experts `Shard(0)` over `ep` and FSDP over `ep_replicate` (`ep_replicate x tp` under tp: experts are not
    tensor-parallel, each tp rank dispatches its sequence shard), each MoE layer with its token dispatcher; the
    data-parallel step then skips them, and under tp the MoE block's unit over `dp_cp_shard x tp` keeps only the
    router (docs/design/0007, 0021)."""
    degrees = ctx.degrees
    if isinstance(config, SingleDeviceConfig):
        raise ValueError(
            f"{family.name}: expert parallelism (ep={degrees.ep}) needs kind='fsdp', 'hsdp' or 'replicate' data "
            f"parallelism, got kind={config.kind!r}: experts are sharded over the expert domain's ranks."
        )
    mixed_precision = config.mixed_precision.build() if config.mixed_precision else None
    if isinstance(config, ReplicateConfig):
        # Replicated dense parameters: the experts must need no data-parallel reduction of their own, i.e. each
        # expert lives on one rank (efsdp = 1); their gradients are whole there (docs/design/0031).
        efsdp = degrees.expert_replicate() * degrees.tp
        if efsdp > 1:
            raise ValueError(
                f"{family.name}: kind='replicate' with ep={degrees.ep} needs every expert on one rank "
                f"(dp_replicate*dp_shard*cp = ep, tp=1), but {degrees.describe()} leaves {efsdp} ranks per expert "
                "shard, whose gradients replicate cannot reduce; use kind='fsdp' or 'hsdp', or set ep to "
                f"{degrees.expert_fold}."
            )
        parallelize_experts(model, ctx, mixed_precision=mixed_precision)
        return
    parallelize_experts(
        model,
        ctx,
        mixed_precision=mixed_precision,
        reshard_after_forward=config.reshard_after_forward,
        offload=config.offload,
    )


def _refuse_unsupported(ctx: DistributedContext, family: Qwen3FamilyPlan) -> None:
    degrees = ctx.degrees
    checked = ("ep",) if not family.has_experts else ()
    asked = {name: getattr(degrees, name) for name in checked if getattr(degrees, name) > 1}
    if asked:
        shown = ", ".join(f"{name}={size}" for name, size in asked.items())
        raise NotImplementedError(
            f"{family.name}: {shown} is not supported yet (expert parallelism needs MoE layers); use ep=1 "
            "for a model without experts."
        )


def _data_parallel(model: nn.Module, ctx: DistributedContext, config: AnyDataParallelConfig) -> GradientSync:
    if ctx.degrees.tp > 1 and isinstance(config, FsdpConfig | HsdpConfig):
        _shard_expert_units(model, ctx, config)
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]
    # On a meta-device model, replicate returns a synchroniser that allocates its buckets at the first step.
    sync = build_data_parallel(_with_default_units(config), model, mesh)
    if isinstance(config, ReplicateConfig) and ctx.degrees.ep > 1:
        # The experts are not replicated (their gradients are whole on their rank): clear them at each step too.
        return GradientSyncs(ModuleGradientSync(model, placed_parameters), sync)
    return sync


def _shard_expert_units(model: nn.Module, ctx: DistributedContext, config: FsdpConfig | HsdpConfig) -> None:
    """Under tp each MoE block sees its rank's tokens only: shard it over `dp_cp_shard x tp` (tp as data ranks)."""
    mesh = expert_units_mesh(ctx.mesh_for(MeshDomain.DENSE))
    policy = config.mixed_precision.build() if config.mixed_precision else None
    for _, moe in select_modules(model, [ByRole(str(Role.MOE))]):
        if isinstance(config, FsdpConfig):
            parallelize_fsdp(
                moe,
                mesh["dp_cp_shard_tp"],
                mixed_precision=policy,
                reshard_after_forward=config.reshard_after_forward,
                offload=config.offload,
            )
        else:
            parallelize_hsdp(
                moe,
                mesh,
                shard_dim="dp_cp_shard_tp",
                mixed_precision=policy,
                reshard_after_forward=config.reshard_after_forward,
                offload=config.offload,
            )


def _with_default_units(config: AnyDataParallelConfig) -> AnyDataParallelConfig:
    if isinstance(config, FsdpConfig | HsdpConfig) and not config.units and not config.unit_roles:
        return config.model_copy(update={"unit_roles": DEFAULT_UNIT_ROLES})
    return config
