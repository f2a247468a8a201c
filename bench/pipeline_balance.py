"""Simulated balance of the pipeline schedules under a measured cost model (CPU, seconds).

For every schedule at `--pp` ranks, `--microbatches` micro-batches and `--num-layers` layers: the simulated bubble
of the even split, and of the best `virtual_layers_pre/post` that `suggest_virtual_layers` finds, for programs built
with uniform costs (today's default) and built with the cost model (`PipelineConfig.costs`: the greedy zero-bubble
builders of ZB-H1 and ZBV plan with it; the other schedules have a fixed order, so both rows are the same). Every
bubble is the program replayed under the cost model. Default costs: the dense anchor on 4 x H200 at 4 x 4096 tokens
per micro-batch (docs/benchmarks.md), in layer-forward units. A simulation: no communication, no host time.

    python3 bench/pipeline_balance.py
    python3 bench/pipeline_balance.py --head-costs 4 8 1 --splits 1f1b=1/7 zbv=4/4
"""

from __future__ import annotations

import argparse
import time

from d9d.pipeline import (
    PipelineConfig,
    PipelineCosts,
    SplitSimulation,
    WorkCost,
    simulate_split,
    suggest_virtual_layers,
)
from pipeline_schedules import SCHEDULES  # one table of schedule configs for both benchmarks


def cost_model(args: argparse.Namespace) -> PipelineCosts:
    def work(values: list[float]) -> WorkCost:
        return WorkCost(forward=values[0], backward_input=values[1], backward_weight=values[2])

    return PipelineCosts(layer=work(args.layer_costs), head=work(args.head_costs), embedding=work(args.embedding_costs))


def describe(result: SplitSimulation) -> str:
    layers = ", ".join(str(count) for count in result.layers_per_stage)
    return f"{result.virtual_layers_pre} / {result.virtual_layers_post} | {layers} | {result.bubble:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b", "zbv", "dualpipe_v"])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=32)
    units = ("F", "I", "W")
    parser.add_argument("--layer-costs", nargs=3, type=float, default=[1.0, 1.0, 1.0], metavar=units)
    parser.add_argument("--head-costs", nargs=3, type=float, default=[5.3, 17.8, 0.0], metavar=units)
    parser.add_argument("--embedding-costs", nargs=3, type=float, default=[0.0, 0.0, 0.3], metavar=units)
    parser.add_argument(
        "--splits", nargs="*", default=["1f1b=1/7", "zbv=4/4", "dualpipe_v=4/4"], help="also simulate SCHEDULE=PRE/POST"
    )
    args = parser.parse_args()
    costs = cost_model(args)
    shape = {"pp": args.pp, "num_layers": args.num_layers, "num_microbatches": args.microbatches}
    started = time.perf_counter()
    print(f"cost model (layer-forward units): {costs.model_dump()}")
    print("| schedule | built with | even split: bubble | best split (pre / post) | layers per stage | bubble |")
    print("|---|---|---|---|---|---|")
    for kind in args.schedules:
        for built_with, model in (("uniform costs", None), ("cost model", costs)):
            config = PipelineConfig.model_validate({"schedule": SCHEDULES[kind], "costs": model})
            even = simulate_split(config, costs=costs, **shape)
            best = suggest_virtual_layers(config, costs=costs, **shape)
            print(f"| {kind} | {built_with} | {even.bubble:.3f} | {describe(best)} |")
    if args.splits:
        print("\n| schedule | built with | split (pre / post) | layers per stage | bubble | makespan |")
        print("|---|---|---|---|---|---|")
        for item in args.splits:
            kind, split = item.split("=")
            pre, post = (int(value) for value in split.split("/"))
            for built_with, model in (("uniform costs", None), ("cost model", costs)):
                split_config = {"virtual_layers_pre": pre, "virtual_layers_post": post}
                config = PipelineConfig.model_validate({"schedule": SCHEDULES[kind], "costs": model, **split_config})
                result = simulate_split(config, costs=costs, **shape)
                print(f"| {kind} | {built_with} | {describe(result)} | {result.makespan:.1f} |")
    print(f"\n({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
