"""What a rank program calls: the pipeline group, the schedule over this rank's stages, the auxiliary-loss sum."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop.protocols import AuxLossWeighting
from d9d.pipeline.config import PipelineConfig, plan_pipeline
from d9d.pipeline.runtime.executor import SplitBackward
from d9d.pipeline.schedule import PipelineSchedule
from d9d.pipeline.stage import PipelineStage


def pipeline_group(ctx: DistributedContext) -> dist.ProcessGroup | None:
    """The ranks that hold the other stages of this rank's model replica (None without pipeline parallelism);
    pass it as `across=` to d9d-parallel's `clip_grad_norm_` so the norm covers every stage."""
    if ctx.degrees.pp == 1:
        return None
    return ctx.mesh_for(MeshDomain.REGULAR)["pp"].get_group()


def pipeline_upstream_group(ctx: DistributedContext) -> dist.ProcessGroup | None:
    """A second group over this rank's pipeline ranks, for the messages to lower pipeline ranks (design 0026; None
    without pipeline parallelism). Every rank creates one per pipeline group of the mesh, in the same order, as
    `new_group` wants: a collective creation, named like the mesh's own groups."""
    if ctx.degrees.pp == 1:
        return None
    mesh = ctx.mesh_for(MeshDomain.REGULAR)
    names = mesh.mesh_dim_names or ()
    by_pipeline = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, ctx.degrees.pp)
    mine: dist.ProcessGroup | None = None
    for ranks in by_pipeline.tolist():
        group = dist.new_group(ranks)
        if ctx.rank in ranks:
            mine = group
    assert isinstance(mine, dist.ProcessGroup), f"rank {ctx.rank} is in no pipeline group of {by_pipeline.tolist()}"
    return mine


def build_pipeline_schedule(
    config: PipelineConfig,
    ctx: DistributedContext,
    *,
    num_layers: int,
    num_microbatches: int,
    build_stage: Callable[[PipelineStage], nn.Module],
    split_backward: SplitBackward | None = None,
) -> PipelineSchedule:
    """Check the plan (the same `ValueError`s as `plan_pipeline`), build this rank's stages with `build_stage`
    (a materialised, parallelised stage module per `PipelineStage`) and return the schedule; give the Trainer
    `schedule.model` as its model and `schedule` as its step schedule. `split_backward`: how split-backward
    schedules split ("store", the default, or "graph"; None reads `D9D_PIPELINE_SPLIT_BACKWARD`). The executor
    replays CUDA graphs when `config.cuda_graphs` is set."""
    plan = plan_pipeline(
        config,
        pp=ctx.degrees.pp,
        num_layers=num_layers,
        num_microbatches=num_microbatches,
        dp_shard=ctx.degrees.dp_shard,
        tp=ctx.degrees.tp,
    )
    rank = ctx.pp_rank
    modules = {stage.index: build_stage(stage) for stage in plan.stages_of(rank)}
    return PipelineSchedule(
        name=config.schedule.kind,
        build=plan.program,
        layout=plan.layout,
        modules=modules,
        pipeline_rank=rank,
        group=pipeline_group(ctx),
        upstream_group=pipeline_upstream_group(ctx),
        device=ctx.device,
        split_backward=split_backward,
        cuda_graphs=config.cuda_graphs,
        plan=plan,
        measure_costs_at_step=config.measure_costs_at_step,
    )


class PipelineAuxLosses:
    """The auxiliary losses of a rank's stages, their logged sum taken over the whole pipeline (every pp rank
    must hold one, with `local=None` where no stage has an auxiliary loss)."""

    def __init__(self, local: AuxLossWeighting | None, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.local, self.group, self.device = local, group, device

    def set_weight(self, weight: float) -> None:
        if self.local is not None:
            self.local.set_weight(weight)

    def take_weighted_sum(self) -> float:
        value = torch.tensor(
            self.local.take_weighted_sum() if self.local is not None else 0.0, dtype=torch.float64, device=self.device
        )
        if self.group is not None:
            dist.all_reduce(value, group=self.group)
        return float(value)
