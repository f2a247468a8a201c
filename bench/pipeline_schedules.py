"""Pipeline schedules on real ranks: tokens/s per GPU and the measured bubble beside the simulated one.

The dense anchor of ../shared/reference/anchors.md (Qwen3-0.6B shape) deepened to 32 layers, split over `pp` =
world size ranks; per step 16 micro-batches of 1 x 4096 tokens (`--microbatch-rows` for more rows), bf16
parameters, AdamW (PyTorch's fused step on CUDA since session 13), clipping at 1.0 summed over the stages. For
every schedule: `--warmup` steps, then `--steps` timed steps (median), then `--profile-steps` steps under
`torch.profiler`. Measured bubble = 1 - (time some compute
kernel runs on the rank's GPU, intervals merged) / step time, averaged over ranks: a GPU inside an NCCL kernel is
waiting for a peer (a receive posted before its data exists spins until it arrives), so communication kernels do
not count as busy; the column `bubble, comm busy` counts them, as the benchmark did before session 7. On CPU
(`--tiny`) the busy time is the executor's compute actions instead. Simulated bubble = the same program replayed
with uniform costs (forward = input gradient = weight gradient); `simulated, stage costs` charges each stage its
layers plus `--embedding-cost-layers` / `--head-cost-layers` (estimates), which shows an unbalanced split.
With a cost model (`--head-costs F I W`, `--embedding-costs F I W`, `--layer-costs F I W`, in layer-forward units;
design note 0027) the zero-bubble builders (ZB-H1, ZBV) plan with it (`PipelineConfig.costs`) and `simulated, cost
model` replays the program under it; `--suggest-split` then picks each schedule's `virtual_layers_pre/post` by
simulation (`suggest_virtual_layers`) instead of `--virtual-layers-pre/post`.

    torchrun --nproc-per-node 4 bench/pipeline_schedules.py                         # 4 GPUs, all schedules
    torchrun --nproc-per-node 4 bench/pipeline_schedules.py --schedules 1f1b zbv
    torchrun --nproc-per-node 4 bench/pipeline_schedules.py --schedules zbv --split-backward graph  # the fallback
    D9D_DEVICE=cpu torchrun --nproc-per-node 2 bench/pipeline_schedules.py --tiny   # seconds, CPU + gloo
    torchrun --nproc-per-node 4 bench/pipeline_schedules.py --schedules zbv --trace-dir T  # + a traced step per rank
    torchrun --nproc-per-node 4 bench/pipeline_schedules.py --microbatch-rows 4 --schedules zbv \
        --head-costs 5.3 17.8 0 --embedding-costs 0 0 0.3 --virtual-layers-pre 4 --virtual-layers-post 3
    python3 bench/pipeline_trace.py T   # per rank: compute, waiting on a peer, starved, host time per action
    torchrun --nproc-per-node 2 bench/pipeline_schedules.py --schedules 1f1b zbv --cuda-graphs  # design note 0028

`--cuda-graphs` replays each step's compute actions as CUDA graphs (`PipelineConfig.cuda_graphs`): the first warm-up
step runs eagerly, the second captures, every timed step replays (the column `graphs` says `replayed`, or the
fallback reason). With graphs the host issues one launch per action, so the measured bubble shows what the GPUs do
without the host on the critical path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import LossResult
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters
from d9d.parallel import clip_grad_norm_
from d9d.pipeline import (
    ActivationSpec,
    PipelineConfig,
    PipelineCosts,
    PipelineSchedule,
    PipelineStage,
    WorkCost,
    build_pipeline_schedule,
    measure_stage_costs,
    pipeline_group,
    suggest_virtual_layers,
)
from d9d.pipeline.program import ActionCosts, Program, StageCost, replay
from d9d.pipeline.runtime import executor as executor_module
from pipeline_trace import measured_costs, print_delays
from trace_summary import union_length

SCHEDULES = {
    "1f1b": {"kind": "1f1b"},
    "interleaved_1f1b": {"kind": "interleaved_1f1b", "stages_per_rank": 2},
    "zb_h1": {"kind": "zb_h1"},
    "zbv": {"kind": "zbv"},
    "dualpipe_v": {"kind": "dualpipe_v"},
}


def schedule_config(kind: str, args: argparse.Namespace) -> dict[str, object]:
    """The schedule's config; the zero-bubble ones get `--activation-memory` (design note 0030)."""
    if kind in ("zb_h1", "zbv"):
        return {**SCHEDULES[kind], "activation_memory": args.activation_memory}
    return SCHEDULES[kind]


ANCHOR = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1e6,
    "vocab_size": 151936,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1e4,
    "vocab_size": 512,
}


@dataclass
class Row:
    schedule: str
    pp: int
    microbatches: int
    microbatch_rows: int
    tokens_per_second_per_gpu: float
    step_seconds: float
    measured_bubble: float
    bubble_counting_comm_busy: float  # the earlier definition: NCCL kernels count as busy
    simulated_bubble: float
    simulated_bubble_stage_costs: float  # each stage charged its layers plus the embedding's and the head's estimate
    simulated_bubble_cost_model: float | None  # replayed under --head/--embedding/--layer-costs (None without them)
    # replayed with each stage's GPU ms per action from the traced step (None without --trace-dir; rank 0 only)
    simulated_bubble_measured_costs: float | None
    virtual_layers: str  # the split run, "pre/post"
    peak_gib: float
    split_backward: str  # how split-backward schedules split (design note 0024); unused by the others
    graphs: str  # "off", "replayed" (every timed step replayed CUDA graphs) or the reason it ran eagerly


class Task:
    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        self.hidden, self.dtype = hidden, dtype

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["labels"].numel()

    def forward_stage(self, module: nn.Module, batch, *, stage: PipelineStage, hidden):  # noqa: ANN001, ANN201
        out = module(
            batch["input_ids"] if stage.is_first else None,
            hidden_states=hidden,
            labels=batch["labels"] if stage.is_last else None,
        )
        return LossResult(loss_sum=out.loss_sum) if stage.is_last else out.hidden_states

    def activation_spec(self, batch, *, stage: PipelineStage) -> ActivationSpec:  # noqa: ANN001
        return ActivationSpec(shape=(*batch["input_ids"].shape, self.hidden), dtype=self.dtype)


def stage_costs(
    config: PipelineConfig, num_layers: int, num_stages: int, args: argparse.Namespace
) -> tuple[float, ...]:
    """Each global stage's cost in decoder layers: its layers, plus `--embedding-cost-layers` on the first stage and
    `--head-cost-layers` on the last (estimates: the simulation's uniform costs cannot see an unbalanced split)."""
    costs = []
    for index in range(num_stages):
        stage = PipelineStage(index, num_stages, config.virtual_layers_pre, config.virtual_layers_post)
        cost = float(len(stage.layers(num_layers)))
        cost += args.embedding_cost_layers if stage.is_first else 0.0
        cost += args.head_cost_layers if stage.is_last else 0.0
        costs.append(cost)
    return tuple(costs)


def cost_model(args: argparse.Namespace) -> PipelineCosts | None:
    """`PipelineCosts` from `--layer-costs/--head-costs/--embedding-costs` (None when neither head nor embedding
    costs are given: the builders plan with uniform costs, as before)."""
    if args.head_costs is None and args.embedding_costs is None:
        return None

    def work(values: list[float] | None) -> WorkCost:
        if values is None:
            return WorkCost()
        return WorkCost(forward=values[0], backward_input=values[1], backward_weight=values[2])

    return PipelineCosts(layer=work(args.layer_costs), head=work(args.head_costs), embedding=work(args.embedding_costs))


def trace_step(
    step: Callable[[], float],
    executor: executor_module.PipelineExecutor,
    kind: str,
    rank: int,
    args: argparse.Namespace,
    *,
    cuda: bool,
) -> None:
    """One more step under the profiler with host activity and every executor action as a named range (compute
    actions through `annotate_actions`, which also covers CUDA-graph replays), exported as a Chrome trace per rank
    (`bench/pipeline_trace.py` reads them: host-bound vs waiting on a peer)."""
    from torch.profiler import ProfilerActivity, profile

    communicate = executor_module.PipelineExecutor._communicate

    def annotated(self, action, task, step_state, *rest):  # noqa: ANN001, ANN002, ANN202
        with record_function(f"pp:{action.kind.name}:s{action.stage}:m{action.microbatch}"):
            return communicate(self, action, task, step_state, *rest)

    try:
        executor_module.PipelineExecutor._communicate = annotated  # type: ignore[method-assign]
        executor.annotate_actions = True
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            step()
    finally:
        executor_module.PipelineExecutor._communicate = communicate  # type: ignore[method-assign]
        executor.annotate_actions = False
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.trace_dir / f"pipeline-{kind}-rows{args.microbatch_rows}-rank{rank}.json"))


def replay_measured(
    program: Program, config: PipelineConfig, num_layers: int, kind: str, args: argparse.Namespace
) -> float | None:
    """Replay `program` with every stage's measured GPU ms per action (the traced step on every rank), print them,
    and print the cost model they imply (layer, head and embedding in layer forwards, for `--layer-costs`,
    `--head-costs`, `--embedding-costs`) with the split `--suggest-split` would pick under it. The replay has no
    communication and no host time: what the measured bubble has beyond it, the runtime adds."""
    paths = sorted(args.trace_dir.glob(f"pipeline-{kind}-rows{args.microbatch_rows}-rank*.json"))
    per_stage = measured_costs(paths)
    num_stages = program.layout.num_stages
    if len(per_stage) < num_stages:
        print(f"#   {kind}: measured costs for stages {sorted(per_stage)} only (traces: {[p.name for p in paths]})")
        return None
    stage_costs_ms = []
    for stage in range(num_stages):
        kinds = per_stage.get(stage, {})
        backward_input = kinds.get("BACKWARD_INPUT", kinds.get("BACKWARD", 0.0))
        stage_costs_ms.append(StageCost(kinds.get("FORWARD", 0.0), backward_input, kinds.get("BACKWARD_WEIGHT", 0.0)))
        print(f"#   {kind} stage {stage} GPU ms per action: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()))
    bubble = replay(program, ActionCosts(stage_costs=tuple(stage_costs_ms))).bubble_fraction
    print_delays(paths)  # what the replay has no model of, per rank
    derived = implied_cost_model(stage_costs_ms, config, num_layers)
    if derived is not None:
        print(f"#   {kind}: measured cost model {cost_flags(derived)}")
        for other in ("1f1b", "interleaved_1f1b", "zbv", "dualpipe_v"):
            planned = PipelineConfig.model_validate(
                {**config.model_dump(), "schedule": schedule_config(other, args), "costs": derived.model_dump()}
            )
            best = suggest_virtual_layers(
                planned, pp=program.layout.pp, num_layers=num_layers, num_microbatches=args.microbatches
            )
            print(
                f"#   {other} planned with it: best split {best.virtual_layers_pre}/{best.virtual_layers_post},"
                f" simulated bubble {best.bubble:.3f}"
            )
    return bubble


def print_measured_costs(
    schedule: PipelineSchedule,
    task: Task,
    batches: list[dict[str, torch.Tensor]],
    tokens: int,
    config: PipelineConfig,
    num_layers: int,
    kind: str,
    *,
    rank: int,
) -> None:
    """`measure_stage_costs` (the in-job timer, CUDA events, no profiler) on one more step, whose gradients are
    dropped; rank 0 prints each stage's ms and the cost model they imply, to compare with the traced measurement."""
    costs, _ = measure_stage_costs(schedule, task, batches, loss_scale=1.0 / tokens)
    schedule.model.zero_grad(set_to_none=True)
    if rank != 0:
        return
    for stage, cost in enumerate(costs):
        print(
            f"#   {kind} stage {stage} in-job ms: F {cost.forward:.2f} I {cost.backward_input:.2f}"
            f" W {cost.backward_weight:.2f}"
        )
    model = implied_cost_model(costs, config, num_layers)
    if model is not None:
        print(f"#   {kind}: in-job cost model {cost_flags(model)}")


def implied_cost_model(costs: Sequence[StageCost], config: PipelineConfig, num_layers: int) -> PipelineCosts | None:
    """The cost model measured per-stage durations imply; None for a full-backward schedule (no halves to tell)."""
    if not any(cost.backward_weight for cost in costs):
        return None
    return PipelineCosts.from_stage_costs(
        costs,
        num_layers,
        virtual_layers_pre=config.virtual_layers_pre,
        virtual_layers_post=config.virtual_layers_post,
    )


def cost_flags(model: PipelineCosts) -> str:
    """`model` as this script's `--layer-costs/--head-costs/--embedding-costs` arguments."""
    return " ".join(
        f"--{name}-costs {work.forward:.2f} {work.backward_input:.2f} {work.backward_weight:.2f}"
        for name, work in (("layer", model.layer), ("head", model.head), ("embedding", model.embedding))
    )


def measure(ctx: DistributedContext, kind: str, args: argparse.Namespace) -> Row:
    shape = TINY if args.tiny else ANCHOR
    overrides = {"vocab_size": args.vocab_size, "num_layers": args.num_layers}
    params = Qwen3DenseParameters(**{**shape, **{key: value for key, value in overrides.items() if value}})
    cuda = ctx.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    decoder = DecoderConfig()  # attention backend: environment, then capability detection
    costs = cost_model(args)
    config = PipelineConfig.model_validate(
        {
            "schedule": schedule_config(kind, args),
            "virtual_layers_pre": args.virtual_layers_pre,
            "virtual_layers_post": args.virtual_layers_post,
            "costs": costs,
            "cuda_graphs": args.cuda_graphs,
        }
    )
    if args.suggest_split:
        best = suggest_virtual_layers(
            config, pp=ctx.degrees.pp, num_layers=params.num_layers, num_microbatches=args.microbatches
        )
        split = {"virtual_layers_pre": best.virtual_layers_pre, "virtual_layers_post": best.virtual_layers_post}
        config = config.model_copy(update=split)
    seq = 64 if args.tiny else 4096

    def build_stage(stage: PipelineStage) -> nn.Module:
        with torch.device("meta"):
            module = Qwen3DenseForCausalLM(params, config=decoder, stage=stage)
        materialize_(module, ctx.device)
        return module.to(dtype)

    schedule = build_pipeline_schedule(
        config,
        ctx,
        num_layers=params.num_layers,
        num_microbatches=args.microbatches,
        build_stage=build_stage,
        split_backward=args.split_backward,
    )
    model, group = schedule.model, pipeline_group(ctx)
    # PyTorch's fused AdamW on CUDA (torchtitan's default): a few launches instead of a dozen per parameter group,
    # so the step's work after the last backward is not host-bound; `--optimizer foreach` for the earlier rows' step.
    fused = cuda and args.optimizer == "fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    task = Task(params.hidden_size, dtype)
    generator = torch.Generator(device="cpu").manual_seed(0)
    shape_of_batch = (args.microbatch_rows, seq)
    batches = [
        {
            "input_ids": torch.randint(0, params.vocab_size, shape_of_batch, generator=generator).to(ctx.device),
            "labels": torch.randint(0, params.vocab_size, shape_of_batch, generator=generator).to(ctx.device),
        }
        for _ in range(args.microbatches)
    ]
    tokens = sum(task.count_tokens(batch) for batch in batches)

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with record_function("pp:step"):  # the traced step's wall: what the timed steps measure
            optimizer.zero_grad(set_to_none=True)
            schedule.run(model, task, batches, loss_scale=1.0 / tokens, backward=True)
            clip_grad_norm_(model.parameters(), 1.0, across=group)
            optimizer.step()
            if cuda:
                torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(args.warmup):
        step()
    if args.measure_costs:
        print_measured_costs(schedule, task, batches, tokens, config, params.num_layers, kind, rank=ctx.rank)
    graphs = schedule.executor.graphs
    replays_before = graphs.replays if graphs is not None else 0
    times = [step() for _ in range(args.steps)]
    if graphs is None:
        graph_state = "off"
    elif graphs.replays - replays_before == args.steps:
        graph_state = "replayed"
    else:
        graph_state = f"eager: {graphs.reason}"
    median = statistics.median(times)

    busy: list[float] = []
    busy_with_comm: list[float] = []
    walls: list[float] = []
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        for _ in range(args.profile_steps):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                wall = step()
            kernels = [
                (event.name, event.time_range.start, event.time_range.end)
                for event in prof.events()
                if event.device_type.name == "CUDA"
            ]
            compute = [(start, end) for name, start, end in kernels if "nccl" not in name.lower()]
            busy.append(union_length(compute) * 1e-6)
            busy_with_comm.append(union_length([(start, end) for _, start, end in kernels]) * 1e-6)
            walls.append(wall)
    else:  # CPU: time inside the executor's compute actions
        intervals: list[tuple[float, float]] = []
        original = executor_module.PipelineExecutor._compute

        def timed(self, action, task, step_state):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            original(self, action, task, step_state)
            intervals.append((start, time.perf_counter()))

        executor_module.PipelineExecutor._compute = timed  # type: ignore[method-assign]
        try:
            for _ in range(args.profile_steps):
                intervals.clear()
                walls.append(step())
                busy.append(union_length(intervals))
                busy_with_comm.append(union_length(intervals))
        finally:
            executor_module.PipelineExecutor._compute = original  # type: ignore[method-assign]
    local_bubble = 1.0 - sum(busy) / sum(walls)
    local_bubble_with_comm = 1.0 - sum(busy_with_comm) / sum(walls)
    bubbles = [torch.zeros(2, dtype=torch.float64, device=ctx.device) for _ in range(ctx.world_size)]
    mine = torch.tensor([local_bubble, local_bubble_with_comm], dtype=torch.float64, device=ctx.device)
    dist.all_gather(bubbles, mine)
    measured = torch.stack(bubbles).mean(dim=0).tolist()
    program = schedule.program(args.microbatches, training=True)
    simulated = replay(program).bubble_fraction
    weights = stage_costs(config, params.num_layers, program.layout.num_stages, args)
    weighted = replay(program, ActionCosts(stage_weights=weights)).bubble_fraction
    modelled = None
    if costs is not None:
        per_stage = costs.stage_costs(
            program.layout.num_stages,
            params.num_layers,
            virtual_layers_pre=config.virtual_layers_pre,
            virtual_layers_post=config.virtual_layers_post,
        )
        modelled = replay(program, ActionCosts(stage_costs=per_stage)).bubble_fraction
    measured_replay = None
    if args.trace_dir is not None:
        trace_step(step, schedule.executor, kind, ctx.rank, args, cuda=cuda)
        dist.barrier()
        if cuda and ctx.rank == 0:
            measured_replay = replay_measured(program, config, params.num_layers, kind, args)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    memory = args.activation_memory if kind in ("zb_h1", "zbv") and args.activation_memory != 1 else None
    return Row(
        schedule=kind if memory is None else f"{kind} (memory x{memory:g})",
        pp=ctx.degrees.pp,
        microbatches=args.microbatches,
        microbatch_rows=args.microbatch_rows,
        tokens_per_second_per_gpu=tokens / median / ctx.world_size,
        step_seconds=median,
        measured_bubble=measured[0],
        bubble_counting_comm_busy=measured[1],
        simulated_bubble=simulated,
        simulated_bubble_stage_costs=weighted,
        simulated_bubble_cost_model=modelled,
        simulated_bubble_measured_costs=measured_replay,
        virtual_layers=f"{config.virtual_layers_pre}/{config.virtual_layers_post}",
        peak_gib=peak,
        split_backward=schedule.executor.split_backward,
        graphs=graph_state,
    )


def optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--schedules", nargs="+", default=["1f1b", "interleaved_1f1b", "zbv", "dualpipe_v"], choices=sorted(SCHEDULES)
    )
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument(
        "--optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW's implementation on CUDA (fused since session 13; foreach before); foreach on CPU",
    )
    parser.add_argument(
        "--microbatch-rows",
        type=int,
        default=1,
        help="rows of 4096 tokens per micro-batch (1: the anchor's 4 rows per GPU at pp=4 and 16 micro-batches)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument(
        "--virtual-layers-pre", type=int, default=0, help="layer slots the embedding takes on the first stage"
    )
    parser.add_argument(
        "--virtual-layers-post",
        type=int,
        default=0,
        help="layer slots the head takes on the last stage (the anchor's fused loss costs about 6.5 layers)",
    )
    parser.add_argument(
        "--head-cost-layers",
        type=float,
        default=4.0,
        help="what the last stage's head and loss cost, in decoder layers, for the stage-cost simulation (an "
        "estimate: 6.4 by FLOPs on the anchor, less where the layers are launch-bound)",
    )
    parser.add_argument("--embedding-cost-layers", type=float, default=0.5, help="the same for the embedding")
    units = ("F", "I", "W")
    parser.add_argument(
        "--head-costs",
        nargs=3,
        type=float,
        metavar=units,
        help="cost model: the head's forward, input gradient and weight gradient in layer forwards (measured on 4 x "
        "H200 at 4 rows: 5.3 17.8 0); the zero-bubble builders plan with it",
    )
    parser.add_argument(
        "--embedding-costs", nargs=3, type=float, metavar=units, help="cost model: the same for the embedding (0 0 0.3)"
    )
    parser.add_argument(
        "--layer-costs", nargs=3, type=float, default=[1.0, 1.0, 1.0], metavar=units, help="cost model: a layer's"
    )
    parser.add_argument(
        "--measure-costs",
        action="store_true",
        help="after the warm-up, time one step's actions in-job (measure_stage_costs) and print the implied model",
    )
    parser.add_argument(
        "--activation-memory",
        type=float,
        default=1.0,
        help="zb_h1/zbv: activation memory a rank may hold, in multiples of 1F1B's (design note 0030)",
    )
    parser.add_argument(
        "--suggest-split",
        action="store_true",
        help="pick virtual_layers_pre/post per schedule by simulation under the cost model (suggest_virtual_layers)",
    )
    parser.add_argument(
        "--vocab-size", type=int, help="override the vocabulary (a small one makes the head cost about one layer)"
    )
    parser.add_argument("--num-layers", type=int, help="override the layer count (32 for the anchor, 8 tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short sequences (CPU smoke run)")
    parser.add_argument(
        "--split-backward", choices=["store", "graph"], default="store", help="weight-gradient store or graph walk"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay the compute actions as CUDA graphs (PipelineConfig.cuda_graphs; needs --warmup 2 or more)",
    )
    parser.add_argument(
        "--trace-dir", type=Path, help="also trace one step per rank (host ranges per action) into this folder"
    )
    args = parser.parse_args()
    if args.suggest_split and cost_model(args) is None:
        parser.error("--suggest-split needs a cost model: --head-costs and/or --embedding-costs")
    ctx = DistributedContext.build(MeshDegrees(pp=int(os.environ.get("WORLD_SIZE", "1"))))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    rows = [measure(ctx, kind, args) for kind in args.schedules]
    if ctx.rank == 0:
        print(
            "| schedule | pp | micro-batches x rows | tokens/s per GPU | step s | measured bubble | bubble, comm busy"
            " | simulated bubble | simulated, stage costs | simulated, cost model | simulated, measured costs"
            " | pre/post | peak GiB | split backward | graphs |",
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row.schedule} | {row.pp} | {row.microbatches} x {row.microbatch_rows}"
                f" | {row.tokens_per_second_per_gpu:,.0f} | {row.step_seconds:.3f} | {row.measured_bubble:.3f}"
                f" | {row.bubble_counting_comm_busy:.3f} | {row.simulated_bubble:.3f}"
                f" | {row.simulated_bubble_stage_costs:.3f}"
                f" | {optional(row.simulated_bubble_cost_model)} | {optional(row.simulated_bubble_measured_costs)}"
                f" | {row.virtual_layers} | {row.peak_gib:.1f} | {row.split_backward} | {row.graphs} |"
            )
        print(json.dumps([asdict(row) for row in rows]))
    ctx.close()


if __name__ == "__main__":
    main()
