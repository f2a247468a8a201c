"""Host time of the parts of a Trainer step that are not forward/backward, through the real `Trainer`.

The step's non-compute parts (zeroing the gradients, the gradient sync's `begin_step`, building the clip list and
clipping, the optimizer step, the preemption check between steps) are pure host work on a GPU: while the host is
in them the GPU idles unless kernels are queued. They scale with the number of parameter *objects*, not their
size, so a tiny model with the dense anchor's parameter structure (28 layers, 311 parameters; hidden 64) measures
them on a CPU too. Everything is timed from the outside with the loop's public hooks, so the script measures any
version of the Trainer: the data source, the gradient sync, the schedule and the clipper are wrapped, the optimizer
step is timed by its pre/post hooks, and the loop's events mark the rest. Times are host wall times (no device
synchronisation is added); the median and the minimum over the timed steps are printed in milliseconds (on a shared
machine the minimum is the steadier estimate of host work).

    python bench/step_host_overhead.py                         # CPU, the tiny 28-layer dense model
    python bench/step_host_overhead.py --device cuda           # one GPU (torch AdamW fused)
    python bench/step_host_overhead.py --data-parallel fsdp    # FSDP2 over one rank instead of no FSDP
    python bench/step_host_overhead.py --data-parallel replicate  # the bucketed all-reduce (one replica)

Phases (one step, in order):
- `before begin_step`: the token count, its sum over ranks and zeroing the gradients;
- `begin_step`: the gradient sync's step start;
- `wait`: the gradient sync's end of step (replicate: the buckets' reductions, here over one replica);
- `clip: parameter list`: from the end of forward/backward to the clipper call (the loop's list of gradients);
- `clip: norm + scale`: the clipper (`d9d.parallel.clip_grad_norm_`, no host read of the norm inside);
- `guard`: the non-finite guard's host reads of the norm and the loss (on a GPU: waits for backward to finish);
- `optimizer.step`: `torch.optim.AdamW` (foreach on CPU, fused on CUDA);
- `after the optimizer`: LR step, metrics, `StepFinished`;
- `between steps`: the preemption check, the GC and checkpoint checks, up to the next step's start.

Totals: `bookkeeping` (the phases that launch no kernels but a replicate bucket's zeroing: before begin_step,
begin_step, wait, the clip list, between steps) and `+ clip norm, optimizer.step`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from anchor_models import DENSE
from d9d.core.dist import DistributedContext
from d9d.core.loop import (
    AccumulationSchedule,
    BuiltModel,
    EventBus,
    ForwardBackwardFinished,
    GradientSync,
    LossResult,
    ModelLoader,
    OptimizerStepped,
    StepFinished,
    StepStarted,
    SyntheticTokenSource,
    TokenBatch,
    TrainerConfig,
    TrainTask,
    build_trainer,
)
from d9d.core.loop.schedule import ScheduleResult
from d9d.core.lr import ConstantScheduleConfig, build_lr_scheduler
from d9d.models import materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, parallelize_qwen3_dense
from d9d.parallel import (
    AnyDataParallelConfig,
    FsdpConfig,
    MixedPrecisionConfig,
    ReplicateConfig,
    SingleDeviceConfig,
    clip_grad_norm_,
)

# The dense anchor's parameter structure (28 layers: 311 parameter objects) at a size where compute is negligible.
TINY_DENSE = DENSE.model_copy(
    update={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 1024,
    }
)
PHASES = [
    "data",
    "before begin_step",
    "begin_step",
    "forward+backward",
    "wait",
    "clip: parameter list",
    "clip: norm + scale",
    "guard",
    "optimizer.step",
    "after the optimizer",
    "between steps",
]
# The loop's bookkeeping (no kernels), then everything outside forward/backward that launches kernels: on a CPU the
# norm and the optimizer step are real compute, on a GPU their host time is the launches.
BOOKKEEPING = ["before begin_step", "begin_step", "wait", "clip: parameter list", "between steps"]
OVERHEAD = [*BOOKKEEPING, "clip: norm + scale", "optimizer.step"]


class Stamps:
    """Host timestamps of the current step, by name."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def mark(self, name: str) -> None:
        self.now[name] = time.perf_counter()

    def timed(self, name: str, call: Callable[[], Any]) -> Any:
        self.mark(f"{name}>")
        try:
            return call()
        finally:
            self.mark(f"{name}<")


class TimedSource(SyntheticTokenSource):
    def __init__(self, stamps: Stamps, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stamps = stamps

    def next_step(self) -> list[TokenBatch]:
        return self.stamps.timed("data", super().next_step)  # type: ignore[no-any-return]


class TimedSync:
    def __init__(self, inner: GradientSync, stamps: Stamps) -> None:
        self.inner, self.stamps = inner, stamps

    def begin_step(self, num_microbatches: int) -> None:
        self.stamps.timed("begin_step", lambda: self.inner.begin_step(num_microbatches))

    def wait(self) -> None:
        self.stamps.timed("wait", self.inner.wait)


class TimedSchedule:
    def __init__(self, stamps: Stamps) -> None:
        self.inner, self.stamps = AccumulationSchedule(), stamps

    def run(
        self, model: nn.Module, task: TrainTask[Any], microbatches: Sequence[Any], *, loss_scale: float, backward: bool
    ) -> ScheduleResult:
        run = lambda: self.inner.run(model, task, microbatches, loss_scale=loss_scale, backward=backward)  # noqa: E731
        return self.stamps.timed("schedule", run)  # type: ignore[no-any-return]


class CausalLMTask:
    def count_tokens(self, batch: TokenBatch) -> int:
        return batch.labels.numel()  # no ignored labels in the synthetic stream: no device read

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        device = next(model.parameters()).device  # the first parameter: a cheap look-up
        ids, labels = batch.input_ids.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
        return LossResult(loss_sum=model(ids, labels=labels).losses.sum())


def phases_of(stamps: Mapping[str, float]) -> dict[str, float]:
    return {
        "data": stamps["data<"] - stamps["data>"],
        "before begin_step": stamps["begin_step>"] - stamps["data<"],
        "begin_step": stamps["begin_step<"] - stamps["begin_step>"],
        "forward+backward": stamps["schedule<"] - stamps["schedule>"],
        "wait": stamps["wait<"] - stamps["wait>"],
        "clip: parameter list": stamps["clip>"] - stamps["backward done"],
        "clip: norm + scale": stamps["clip<"] - stamps["clip>"],
        "guard": stamps["optimizer>"] - stamps["clip<"],
        "optimizer.step": stamps["optimizer<"] - stamps["optimizer>"],
        "after the optimizer": stamps["finished"] - stamps["optimizer<"],
        "between steps": stamps["next started"] - stamps["finished"],
    }


def measure(
    *, device: str, data_parallel: Literal["single", "fsdp", "replicate"], layers: int, warmup: int, steps: int
) -> tuple[dict[str, float], dict[str, float], int]:
    """Median and minimum host milliseconds per phase over `steps` timed steps after `warmup` steps."""
    params = TINY_DENSE.model_copy(update={"num_layers": layers})
    stamps = Stamps()
    ctx = DistributedContext.build(device=device)
    fused = ctx.device.type == "cuda"

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        with torch.device("meta"):
            model = Qwen3DenseForCausalLM(params)
        # float32 parameters, gradients accumulated in float32: torch AdamW needs gradients in the parameters'
        # dtype; the reduce dtype still makes the single-device sync manage `grad_dtype` as in bf16 training.
        precision = MixedPrecisionConfig(param_dtype=None, reduce_dtype="float32")
        config: AnyDataParallelConfig
        match data_parallel:
            case "single":
                config = SingleDeviceConfig(mixed_precision=precision)
            case "fsdp":
                config = FsdpConfig(mixed_precision=precision)
            case "replicate":
                config = ReplicateConfig(mixed_precision=precision)
        sync = parallelize_qwen3_dense(model, ctx, config)
        materialize_(model, ctx.device)
        return BuiltModel(model=model, gradient_sync=TimedSync(sync, stamps))

    def optimizer_provider(model: nn.Module) -> Optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused or None)
        optimizer.register_step_pre_hook(lambda *_: stamps.mark("optimizer>"))
        optimizer.register_step_post_hook(lambda *_: stamps.mark("optimizer<"))
        return optimizer

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(ConstantScheduleConfig(), optimizer, total_steps)

    def data_provider(ctx: DistributedContext, microbatches: int) -> TimedSource:
        stream = {"seed": 1, "global_rows": 1, "microbatch_rows": 1, "seq_len": 16, "dp_rank": 0, "dp_size": 1}
        return TimedSource(stamps, vocab_size=params.vocab_size, **stream)

    def clipper(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return stamps.timed("clip", lambda: clip_grad_norm_(parameters, max_norm))  # type: ignore[no-any-return]

    def on_started(event: StepStarted) -> None:
        if stamps.now:
            stamps.mark("next started")
            stamps.steps.append(phases_of(stamps.now))
        stamps.now = {}

    events = EventBus()
    events.subscribe(StepStarted, on_started)
    events.subscribe(ForwardBackwardFinished, lambda event: stamps.mark("backward done"))
    events.subscribe(OptimizerStepped, lambda event: None)
    events.subscribe(StepFinished, lambda event: stamps.mark("finished"))
    config = TrainerConfig(
        total_steps=warmup + steps + 1, global_batch_rows=1, microbatch_rows=1, max_grad_norm=1.0, gc_every=1000
    )
    trainer = build_trainer(
        ctx, config, model_provider=model_provider, task=CausalLMTask(), data_provider=data_provider,
        optimizer_provider=optimizer_provider, lr_scheduler_provider=lr_provider, clipper=clipper,
        schedule=TimedSchedule(stamps), events=events,
    )  # fmt: skip
    count = sum(1 for _ in trainer.parts.model.parameters())
    trainer.train()
    ctx.close()
    timed = stamps.steps[warmup:]
    medians = {name: 1e3 * statistics.median(step[name] for step in timed) for name in PHASES}
    minima = {name: 1e3 * min(step[name] for step in timed) for name in PHASES}
    return medians, minima, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--data-parallel", choices=["single", "fsdp", "replicate"], default="single")
    parser.add_argument("--layers", type=int, default=DENSE.num_layers)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    medians, minima, count = measure(
        device=args.device, data_parallel=args.data_parallel, layers=args.layers, warmup=args.warmup, steps=args.steps
    )
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}; the dense anchor's structure at hidden 64: {args.layers} layers, ")
    print(f"# {count} parameters, dp={args.data_parallel}; host ms over {args.steps} steps")
    print("| phase | median ms | min ms |")
    print("|---|---|---|")
    for phase in PHASES:
        print(f"| {phase} | {medians[phase]:.3f} | {minima[phase]:.3f} |")
    for label, phases in (("bookkeeping", BOOKKEEPING), ("+ clip norm, optimizer.step", OVERHEAD)):
        median, least = sum(medians[p] for p in phases), sum(minima[p] for p in phases)
        print(f"| **{label}** | {median:.3f} | {least:.3f} |")


if __name__ == "__main__":
    main()
