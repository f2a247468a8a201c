"""Choosing `virtual_layers_pre/post` by simulation: the split whose program replays fastest under a cost model.

A simulation, not a measurement: the replay charges each action its stage's `StageCost` (from `PipelineCosts`),
with no communication time, no host overhead and no kernel overlap. It ranks splits well where the GPU sets the
pace and the costs were measured on the same model and micro-batch size (docs/pipeline.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from d9d.pipeline.config import PipelineConfig, PipelinePlan, plan_pipeline
from d9d.pipeline.costs import PipelineCosts
from d9d.pipeline.program import ActionCosts, replay
from d9d.pipeline.stage import PipelineStage


@dataclass(frozen=True)
class SplitSimulation:
    """One split of the layers and its simulated step under the cost model."""

    virtual_layers_pre: int
    virtual_layers_post: int
    layers_per_stage: tuple[int, ...]
    makespan: float  # simulated step time, in the cost model's unit (decoder-layer forwards)
    bubble: float  # simulated idle time over (ranks x makespan)


def simulate_split(
    config: PipelineConfig, *, pp: int, num_layers: int, num_microbatches: int, costs: PipelineCosts | None = None
) -> SplitSimulation:
    """Plan `config` (raises `ValueError` naming the values if it cannot run) and replay its program under `costs`
    (default: `config.costs`, else uniform layers and a free embedding and head)."""
    plan = plan_pipeline(config, pp=pp, num_layers=num_layers, num_microbatches=num_microbatches)
    return _simulate(plan, num_microbatches, costs or config.costs or PipelineCosts())


def _simulate(plan: PipelinePlan, num_microbatches: int, costs: PipelineCosts) -> SplitSimulation:
    config, layout = plan.config, plan.layout
    stage_costs = costs.stage_costs(
        layout.num_stages,
        plan.num_layers,
        virtual_layers_pre=config.virtual_layers_pre,
        virtual_layers_post=config.virtual_layers_post,
    )
    timeline = replay(plan.program(num_microbatches), ActionCosts(stage_costs=stage_costs))
    return SplitSimulation(
        virtual_layers_pre=config.virtual_layers_pre,
        virtual_layers_post=config.virtual_layers_post,
        layers_per_stage=_layers_per_stage(config, layout.num_stages, plan.num_layers),
        makespan=timeline.makespan,
        bubble=timeline.bubble_fraction,
    )


def _layers_per_stage(config: PipelineConfig, num_stages: int, num_layers: int) -> tuple[int, ...]:
    return tuple(
        len(PipelineStage(index, num_stages, config.virtual_layers_pre, config.virtual_layers_post).layers(num_layers))
        for index in range(num_stages)
    )


def suggest_virtual_layers(
    config: PipelineConfig,
    *,
    pp: int,
    num_layers: int,
    num_microbatches: int,
    max_virtual_layers: int | None = None,
    costs: PipelineCosts | None = None,
) -> SplitSimulation:
    """The `virtual_layers_pre/post` (each in `[0, max_virtual_layers]`, default twice a stage's even share) whose
    program has the smallest simulated step time under `costs` (default `config.costs`; a simulation: see the module
    docstring). Programs are built as `config` builds them: with `config.costs` when set, else uniform.

    Only splits that give every stage at least one real layer (and equal shares under `even_split`) are tried; the
    program is rebuilt for each, so a cost-aware zero-bubble schedule is planned for that split. Ties go to the
    fewest virtual layers. `config`'s own `virtual_layers_pre/post` are ignored; raises `ValueError` naming the values
    if the schedule cannot run at all.
    """
    even = config.model_copy(update={"virtual_layers_pre": 0, "virtual_layers_post": 0})
    baseline = plan_pipeline(even, pp=pp, num_layers=num_layers, num_microbatches=num_microbatches)
    num_stages = baseline.layout.num_stages
    limit = 2 * -(-num_layers // num_stages) if max_virtual_layers is None else max_virtual_layers
    if limit < 0:
        raise ValueError(f"max_virtual_layers={max_virtual_layers} must be non-negative")
    costs = costs or config.costs or PipelineCosts()
    best: SplitSimulation | None = None
    seen: set[tuple[int, ...]] = set()
    for total in range(2 * limit + 1):  # fewest virtual layers first, so ties keep the simplest split
        for pre in range(max(0, total - limit), min(total, limit) + 1):
            candidate = even.model_copy(update={"virtual_layers_pre": pre, "virtual_layers_post": total - pre})
            layers = _layers_per_stage(candidate, num_stages, num_layers)
            if layers in seen or min(layers) < 1 or (config.even_split and (num_layers + total) % num_stages):
                continue
            seen.add(layers)
            plan = PipelinePlan(config=candidate, layout=baseline.layout, num_layers=num_layers)
            result = _simulate(plan, num_microbatches, costs)
            if best is None or result.makespan < best.makespan - 1e-9:
                best = result
    if best is None:  # the even split itself gives some stage no layer
        raise ValueError(
            f"num_layers={num_layers} cannot give each of the {num_stages} stages a real layer with at most "
            f"{limit} virtual layers before and after"
        )
    return best
