"""The evaluate rank program: held-out loss, perplexity and bits per byte of a job checkpoint, with Inference.

    torchrun --nproc-per-node N -m d9d.flows.jobs.evaluate.program --config evaluate.yaml

Bits per byte uses the shard set's bytes per token (`num_bytes / num_tokens` of its index): packed rows cut
documents, so per-row byte counts do not exist; over a whole pass the ratio is exact. Rank 0 writes
`evaluation.json` and `evaluation.md` into `output`, and with `downstream` set, `downstream.json`: the scores of
lm-eval tasks (lm_eval's own evaluator over d9d's adapter) and greedy continuations of fixed prompts. With
`downstream` and `degrees.tp > 1` the model is built without sequence parallelism (`whole_sequence_topology`).

    torchrun --nproc-per-node N -m d9d.flows.jobs.evaluate.program --suite --config suite.yaml

evaluates several models (each its own architecture, a job checkpoint or converted safetensors weights) over the
same held-out set in one launch, each report into `output/<name>/`. The evaluate stage uses this form.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from d9d.core.checkpoint import latest_complete, load_model_weights
from d9d.core.config import load_config
from d9d.core.data import PackedTokenDataset, TokenShardIndex
from d9d.core.data.loader_config import SequentialOrderConfig
from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, Inference
from d9d.core.loop.trainer import TRAINER_STATE_FILE
from d9d.flows.jobs.evaluate.config import DownstreamConfig, EvaluateConfig, EvaluateSuiteConfig
from d9d.flows.jobs.evaluate.downstream import DownstreamEvaluator
from d9d.flows.jobs.launch import emit_progress, prepare_rank
from d9d.flows.jobs.rank_wiring import (
    build_rank_model,
    data_parallel_size,
    log_topology,
    packed_loader,
    packed_source,
    packed_task,
)
from d9d.flows.jobs.weights import load_converted_weights
from d9d.metrics import BitsPerByteMetric, PerplexityMetric
from d9d.metrics.trackers import build_tracker

DOWNSTREAM_JSON = "downstream.json"  # a candidate's task scores and sample continuations
DATASETS_CACHE = ".datasets-cache"  # lm_eval's dataset cache per rank, under the suite's output


@dataclass(frozen=True, kw_only=True)
class EvaluationReport:
    checkpoint: str | None
    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int


def resolve_checkpoint(path: Path | None) -> Path | None:
    if path is None or (path / "COMPLETE").is_file():
        return path
    latest = latest_complete(path)
    if latest is None:
        raise FileNotFoundError(f"checkpoint={path}: neither a complete checkpoint nor a directory holding one")
    return latest


def load_model(config: EvaluateConfig, ctx: DistributedContext) -> tuple[BuiltModel, Path | None]:
    """The configured model on `ctx` with its weights (a job checkpoint, converted weights, or the seeded init), and
    where they came from."""
    seed_everything(config.seed, ctx)
    checkpoint = resolve_checkpoint(config.checkpoint)
    if checkpoint is not None and config.weights is not None:
        raise ValueError(f"checkpoint={config.checkpoint} and weights={config.weights}: set one of them, not both")
    topology = whole_sequence_topology(config) if config.downstream is not None else config
    built = build_rank_model(topology, config.model, ctx, microbatches_per_step=1)  # one micro-batch per step
    if checkpoint is not None:
        load_model_weights(checkpoint, built.model)
    elif config.weights is not None:
        load_converted_weights(config.weights, built.model, pipeline_stages=ctx.degrees.pp > 1)
    return built, checkpoint if checkpoint is not None else config.weights


def whole_sequence_topology(config: EvaluateConfig) -> EvaluateConfig:
    """`config` with tensor parallelism's replicated-activation layout: task scoring forwards any length and
    generation's decode steps one token per row, neither of which sequence parallelism can split (docs/design/0019).
    The held-out loss is the same either way (the same sums, reduced in another order); async TP has nothing to
    fuse without sequence parallelism, so it is off."""
    if config.degrees.tp <= 1 or not config.tensor_parallel.sequence_parallel:
        return config
    layout = config.tensor_parallel.model_copy(update={"sequence_parallel": False, "async_tp": False})
    return config.model_copy(update={"tensor_parallel": layout})


def run_evaluate(
    config: EvaluateConfig, ctx: DistributedContext, loaded: tuple[BuiltModel, Path | None] | None = None
) -> EvaluationReport:
    """Held-out loss, perplexity and bits per byte of the configured model (or of `loaded`, from `load_model`)."""
    built, source = loaded if loaded is not None else load_model(config, ctx)
    dp_size = data_parallel_size(ctx)
    if config.rows_per_step % dp_size:
        raise ValueError(f"rows_per_step={config.rows_per_step} must be a multiple of the data-parallel size {dp_size}")
    rows = len(PackedTokenDataset(config.shards, seq_len=config.seq_len))
    steps = config.steps or rows // config.rows_per_step
    if steps < 1:
        raise ValueError(f"{rows} rows of {config.seq_len} tokens make no step of {config.rows_per_step} rows")
    loader = packed_loader(
        ctx,
        config.shards,
        seq_len=config.seq_len,
        global_batch_rows=config.rows_per_step,
        order=SequentialOrderConfig(),
        epochs=1,
    )
    task = packed_task(config, config.model)
    inference = Inference(
        ctx, model=built.model, task=task, data=packed_source(ctx, loader, 1), schedule=built.schedule
    )
    result = inference.run(steps)
    # The figures come from d9d-metrics (one definition of each); the loop's loss is already over every rank.
    index = TokenShardIndex.read(config.shards)
    loss_sum = result.loss * result.tokens
    perplexity, bits_per_byte = PerplexityMetric(), BitsPerByteMetric()
    perplexity.update(loss_sum, result.tokens)
    bits_per_byte.update(loss_sum, result.tokens * index.num_bytes / max(index.num_tokens, 1))
    return EvaluationReport(
        checkpoint=str(source) if source is not None else None,
        loss=result.loss,
        perplexity=perplexity.compute(),
        bits_per_byte=bits_per_byte.compute(),
        tokens=result.tokens,
    )


def write_report(report: EvaluationReport, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "evaluation.json").write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
    markdown = (
        f"# Evaluation\n\ncheckpoint: `{report.checkpoint}`\n\n| loss | perplexity | bits per byte | tokens |\n"
        f"|---|---|---|---|\n| {report.loss:.4f} | {report.perplexity:.2f} | {report.bits_per_byte:.4f} "
        f"| {report.tokens:,} |\n"
    )
    (output / "evaluation.md").write_text(markdown, encoding="utf-8")


def log_report(report: EvaluationReport, config: EvaluateConfig, downstream: dict[str, Any] | None = None) -> str:
    """Log the results (and the task scores of `downstream`, as `evaluate/<task>/<metric>`) as a new run of the
    training run's family (the same aim experiment, wandb group, JSONL or TensorBoard directory) at the evaluated
    checkpoint's step; call it on the main process. Returns the run's id."""
    step = 0
    if report.checkpoint is not None and (Path(report.checkpoint) / TRAINER_STATE_FILE).is_file():
        step = int(json.loads((Path(report.checkpoint) / TRAINER_STATE_FILE).read_text(encoding="utf-8"))["step"])
    tracker = build_tracker(config.tracker, enabled=True, hparams=config.model_dump(mode="json"), name=config.run_name)
    values = {"loss": report.loss, "perplexity": report.perplexity, "bits_per_byte": report.bits_per_byte}
    for task, result in (downstream or {}).get("tasks", {}).items():
        values |= {f"{task}/{metric}": value for metric, value in result["metrics"].items()}
    tracker.log(step, {f"evaluate/{name}": value for name, value in values.items()})
    run_id = tracker.run_id  # before close: an aim tracker would open a new run after it
    tracker.close()
    return run_id


def downstream_evaluator(config: DownstreamConfig, root: Path, ctx: DistributedContext) -> DownstreamEvaluator:
    """Every rank scores the same requests: the process group is the whole job when it has several ranks."""
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    cache = root / DATASETS_CACHE / f"rank-{dist.get_rank() if dist.is_initialized() else 0}"
    return DownstreamEvaluator(config, cache_dir=cache, process_group=group)


def write_downstream(downstream: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / DOWNSTREAM_JSON).write_text(json.dumps(downstream, indent=2) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    prepare_rank()  # its Python stack on SIGUSR2, for the launcher's report of a failed group
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--suite", action="store_true", help="the config is a suite of candidates")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.suite:
        suite = load_config(EvaluateSuiteConfig, args.config, args.overrides)
        configs = [suite.single(candidate) for candidate in suite.candidates]
    else:
        configs = [load_config(EvaluateConfig, args.config, args.overrides)]
    first = configs[0]
    with DistributedContext.build(first.degrees, device=first.device, timeout=timedelta(minutes=10)) as ctx:
        log_topology("evaluate", first, ctx)
        evaluator: DownstreamEvaluator | None = None
        for config in configs:
            loaded = load_model(config, ctx)
            report = run_evaluate(config, ctx, loaded)
            downstream = None
            if config.downstream is not None:
                if evaluator is None:  # once per launch: lm_eval loads the tasks' data once for every model
                    evaluator = downstream_evaluator(config.downstream, config.output.parent, ctx)
                downstream = evaluator.evaluate(loaded[0].model)
                if ctx.is_main_process:
                    write_downstream(downstream, config.output)
            if ctx.is_main_process:
                write_report(report, config.output)
                run_id = log_report(report, config, downstream)
                emit_progress({"event": "evaluated", "output": str(config.output), "tracker_run_id": run_id})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
