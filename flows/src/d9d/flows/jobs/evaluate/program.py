"""The evaluate rank program: held-out loss, perplexity and bits per byte of a job checkpoint, with Inference.

    torchrun --nproc-per-node N -m d9d.flows.jobs.evaluate.program --config evaluate.yaml

Bits per byte uses the shard set's bytes per token (`num_bytes / num_tokens` of its index): packed rows cut
documents, so per-row byte counts do not exist; over a whole pass the ratio is exact. Rank 0 writes
`evaluation.json` and `evaluation.md` into `output`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.core.checkpoint import latest_complete, load_model_weights
from d9d.core.config import load_config
from d9d.core.data import DataParallelLoader, PackedTokenDataset, SequentialOrder, TokenShardIndex, collate_packed
from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import Inference, LoaderDataSource
from d9d.flows.jobs.pretrain.config import AnyModelConfig
from d9d.flows.jobs.pretrain.program import PackedCausalLMTask, model_provider_for
from d9d.parallel import AnyDataParallelConfig, FsdpConfig


class EvaluateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: AnyModelConfig
    shards: Path = Field(description="held-out token-shard set (the data-prep stage's validation split)")
    seq_len: int = Field(gt=0)
    rows_per_step: int = Field(default=8, gt=0, description="rows per step over all data-parallel ranks")
    steps: int | None = Field(default=None, ge=1, description="None: one pass over the set")
    checkpoint: Path | None = Field(
        default=None, description="a job checkpoint folder, or a directory of them (newest complete); None: init"
    )
    output: Path
    degrees: MeshDegrees = Field(default_factory=lambda: MeshDegrees(dp_shard=-1))
    data_parallel: AnyDataParallelConfig = Field(default_factory=FsdpConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0


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


def run_evaluate(config: EvaluateConfig, ctx: DistributedContext) -> EvaluationReport:
    seed_everything(config.seed, ctx)
    checkpoint = resolve_checkpoint(config.checkpoint)
    built = model_provider_for(config.model, config.data_parallel)(ctx, None)
    if checkpoint is not None:
        load_model_weights(checkpoint, built.model)
    dataset = PackedTokenDataset(config.shards, seq_len=config.seq_len)
    layout = ctx.layout_for(MeshDomain.BATCH)
    dp_size = layout.shape[layout.dim_names.index("dp")]
    if config.rows_per_step % dp_size:
        raise ValueError(f"rows_per_step={config.rows_per_step} must be a multiple of the data-parallel size {dp_size}")
    loader = DataParallelLoader(
        dataset,
        order=SequentialOrder(len(dataset)),
        global_batch_size=config.rows_per_step,
        dp_rank=ctx.coordinate(MeshDomain.BATCH)["dp"],
        dp_size=dp_size,
        collate_fn=collate_packed,
        epochs=1,
    )
    steps = config.steps or len(dataset) // config.rows_per_step
    if steps < 1:
        raise ValueError(f"{len(dataset)} rows of {config.seq_len} tokens make no step of {config.rows_per_step} rows")
    inference = Inference(ctx, model=built.model, task=PackedCausalLMTask(), data=LoaderDataSource(loader, 1))
    result = inference.run(steps)
    index = TokenShardIndex.read(config.shards)
    bytes_per_token = index.num_bytes / max(index.num_tokens, 1)
    return EvaluationReport(
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        loss=result.loss,
        perplexity=result.perplexity,
        bits_per_byte=result.loss / (math.log(2) * bytes_per_token),
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load_config(EvaluateConfig, args.config, args.overrides)
    with DistributedContext.build(config.degrees, device=config.device, timeout=timedelta(minutes=10)) as ctx:
        report = run_evaluate(config, ctx)
        if ctx.is_main_process:
            write_report(report, config.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
