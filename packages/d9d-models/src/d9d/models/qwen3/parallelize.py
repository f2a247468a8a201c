"""Parallel plans for the Qwen3 families: data parallelism (replicate, FSDP, HSDP) over a stage's modules.

Modules are found by the roles the models declare (`d9d.models.roles.Role`), never by class: with FSDP/HSDP each
decoder layer, the embedding and the LM head become their own units (unless the config names its own units), and the
rest (final norm) joins the root unit. Context parallelism (`cp`) swaps a sequence-sharded attention into every
attention layer (`parallelize_context`; batches must be sharded by `d9d.parallel.context`). Tensor and expert
parallelism are not implemented yet: a topology asking for them is refused up front rather than silently trained as
data parallelism.
"""

from __future__ import annotations

from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.models.blocks.context_parallel import parallelize_context
from d9d.models.roles import Role
from d9d.parallel import AnyDataParallelConfig, FsdpConfig, GradientSync, HsdpConfig, build_data_parallel
from d9d.parallel.context import ContextParallelConfig

DEFAULT_UNIT_ROLES = [str(Role.DECODER_LAYER), str(Role.EMBEDDING), str(Role.LM_HEAD)]


def _refuse_unsupported(ctx: DistributedContext, model_name: str) -> None:
    degrees = ctx.degrees
    asked = {name: getattr(degrees, name) for name in ("tp", "ep") if getattr(degrees, name) > 1}
    if asked:
        shown = ", ".join(f"{name}={size}" for name, size in asked.items())
        raise NotImplementedError(
            f"{model_name}: {shown} is not supported yet (tensor and expert parallelism are planned); "
            "use pp, dp_replicate, dp_shard and cp only, with tp=ep=1."
        )


def _with_default_units(config: AnyDataParallelConfig) -> AnyDataParallelConfig:
    if isinstance(config, FsdpConfig | HsdpConfig) and not config.units and not config.unit_roles:
        return config.model_copy(update={"unit_roles": DEFAULT_UNIT_ROLES})
    return config


def _parallelize(
    model: nn.Module,
    ctx: DistributedContext,
    config: AnyDataParallelConfig,
    name: str,
    context: ContextParallelConfig | None,
) -> GradientSync:
    _refuse_unsupported(ctx, name)
    parallelize_context(model, ctx, context)
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_replicate", "dp_cp_shard"]
    # On a meta-device model, replicate returns a synchroniser that allocates its buckets at the first step.
    return build_data_parallel(_with_default_units(config), model, mesh)


def parallelize_qwen3_dense(
    model: nn.Module,
    ctx: DistributedContext,
    config: AnyDataParallelConfig,
    *,
    context: ContextParallelConfig | None = None,
) -> GradientSync:
    """Apply `config` to a (stage of a) Qwen3 dense model built on the meta device, before `materialize_`.

    Returns what the training loop drives per step (`begin_step`, `wait`). With `cp > 1`, `context` picks the
    attention variant (default: ring).

    Raises:
        NotImplementedError: the topology has tp or ep above 1.
    """
    return _parallelize(model, ctx, config, "parallelize_qwen3_dense", context)


def parallelize_qwen3_moe(
    model: nn.Module,
    ctx: DistributedContext,
    config: AnyDataParallelConfig,
    *,
    context: ContextParallelConfig | None = None,
) -> GradientSync:
    """Like `parallelize_qwen3_dense`; experts are data-parallel parameters like any other (sharded along the expert
    dimension under FSDP) until expert parallelism lands.

    Raises:
        NotImplementedError: the topology has tp or ep above 1.
    """
    return _parallelize(model, ctx, config, "parallelize_qwen3_moe", context)
