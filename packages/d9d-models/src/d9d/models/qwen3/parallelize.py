"""Parallel plans for the Qwen3 families: data parallelism (replicate, FSDP, HSDP) over a stage's modules.

Modules are found by the roles the models declare (`d9d.models.roles.Role`), never by class: with FSDP/HSDP each
decoder layer, the embedding and the LM head become their own units (unless the config names its own units), and the
rest (final norm) joins the root unit. Qwen3-MoE adds expert parallelism (`ep > 1`) before that: experts sharded
over the expert domain, tokens dispatched (see `parallelize_experts`). Tensor and context parallelism are not
implemented yet: a topology asking for them is refused up front rather than silently trained as data parallelism.
"""

from __future__ import annotations

from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.models.blocks.moe import parallelize_experts
from d9d.models.roles import Role
from d9d.parallel import (
    AnyDataParallelConfig,
    FsdpConfig,
    GradientSync,
    HsdpConfig,
    ReplicateConfig,
    build_data_parallel,
)

DEFAULT_UNIT_ROLES = [str(Role.DECODER_LAYER), str(Role.EMBEDDING), str(Role.LM_HEAD)]


def _refuse_unsupported(ctx: DistributedContext, model_name: str, supported: tuple[str, ...] = ()) -> None:
    degrees = ctx.degrees
    checked = [name for name in ("tp", "cp", "ep") if name not in supported]
    asked = {name: getattr(degrees, name) for name in checked if getattr(degrees, name) > 1}
    if asked:
        shown = ", ".join(f"{name}={size}" for name, size in asked.items())
        raise NotImplementedError(
            f"{model_name}: {shown} is not supported yet (tensor, context and expert parallelism are planned); "
            "use pp, dp_replicate and dp_shard only, with tp=cp=ep=1."
        )


def _with_default_units(config: AnyDataParallelConfig) -> AnyDataParallelConfig:
    if isinstance(config, FsdpConfig | HsdpConfig) and not config.units and not config.unit_roles:
        return config.model_copy(update={"unit_roles": DEFAULT_UNIT_ROLES})
    return config


def _parallelize(
    model: nn.Module, ctx: DistributedContext, config: AnyDataParallelConfig, name: str, supported: tuple[str, ...] = ()
) -> GradientSync:
    _refuse_unsupported(ctx, name, supported)
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]
    # On a meta-device model, replicate returns a synchroniser that allocates its buckets at the first step.
    return build_data_parallel(_with_default_units(config), model, mesh)


def parallelize_qwen3_dense(model: nn.Module, ctx: DistributedContext, config: AnyDataParallelConfig) -> GradientSync:
    """Apply `config` to a (stage of a) Qwen3 dense model built on the meta device, before `materialize_`.

    Returns what the training loop drives per step (`begin_step`, `wait`).

    Raises:
        NotImplementedError: the topology has tp, cp or ep above 1.
    """
    return _parallelize(model, ctx, config, "parallelize_qwen3_dense")


def parallelize_qwen3_moe(model: nn.Module, ctx: DistributedContext, config: AnyDataParallelConfig) -> GradientSync:
    """Like `parallelize_qwen3_dense`. With `ep == 1` experts are data-parallel parameters like any other (sharded
    along the expert dimension under FSDP); with `ep > 1` they are expert-parallel first (`parallelize_experts`,
    with the data-parallel config's mixed precision), and the dense parameters then get `config`.

    Raises:
        NotImplementedError: the topology has tp or cp above 1.
        ValueError: `ep > 1` with replicate data parallelism (use fsdp or hsdp), or an `ep` the experts cannot split.
    """
    if ctx.degrees.ep > 1:
        _parallelize_experts(model, ctx, config)
    return _parallelize(model, ctx, config, "parallelize_qwen3_moe", supported=("ep",))


def _parallelize_experts(model: nn.Module, ctx: DistributedContext, config: AnyDataParallelConfig) -> None:
    if isinstance(config, ReplicateConfig):
        raise ValueError(
            f"expert parallelism (ep={ctx.degrees.ep}) needs kind='fsdp' or kind='hsdp' data parallelism, got "
            "kind='replicate': the bucketed replicate synchroniser would all-reduce expert gradients over ranks that "
            "hold different experts."
        )
    _refuse_unsupported(ctx, "parallelize_qwen3_moe", supported=("ep",))
    mixed_precision = config.mixed_precision.build() if config.mixed_precision else None
    parallelize_experts(model, ctx, mixed_precision=mixed_precision, reshard_after_forward=config.reshard_after_forward)
