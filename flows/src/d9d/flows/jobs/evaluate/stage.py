"""The evaluate stage under the stage contract: held-out loss, perplexity and bits per byte of each checkpoint.

Candidates: `pretrain` (the newest complete checkpoint of the pretrain stage) and `base` (the convert stage's
output, when `base` is on and its vocabulary covers the tokenizer's: a model whose embedding table is smaller than
the token ids cannot read the data). All run in one `torchrun` launch of the evaluate rank program over the
data-prep stage's validation split. The stage writes `evaluation.json`, `evaluation.md` and `loss_curve.png`
(training loss per step with each checkpoint's held-out loss). No Prefect here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from d9d.flows.jobs.contract import (
    MANIFEST_FILENAME,
    Completeness,
    FileFingerprint,
    PartialStage,
    StageDirectory,
    StageKey,
    StageManifest,
    StageResult,
    StageStatus,
    package_versions,
)
from d9d.flows.jobs.evaluate.plot import PlotUnavailable, plot_loss_curve
from d9d.flows.jobs.evaluate.program import EvaluateCandidate, EvaluateSuiteConfig
from d9d.flows.jobs.launch import LaunchSpec, launch
from d9d.flows.jobs.pretrain.config import AnyModelConfig, Qwen3DenseModelConfig, Qwen3MoeModelConfig
from d9d.flows.jobs.pretrain.stage import CHECKPOINTS_DIR, LOSSES_FILE, PARAMETERS_FILE, read_losses
from d9d.flows.jobs.progress import Progress
from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeParameters

STAGE_NAME = "evaluate"
STAGE_VERSION = 1
RECORDED_PACKAGES = ("d9d-core", "d9d-models", "d9d-flows", "torch")
SUITE_FILE = "suite.yaml"
LOG_FILE = "launch.log"
REPORT_JSON = "evaluation.json"
REPORT_MARKDOWN = "evaluation.md"
LOSS_CURVE = "loss_curve.png"


class EvaluateStageConfig(BaseModel):
    """The `evaluate` section of a job: how much of the validation split, on how many ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int | None = Field(default=None, gt=0, description="None: the pretrain stage's seq_len")
    rows_per_step: int = Field(default=8, gt=0, description="rows per step over all ranks")
    steps: int | None = Field(default=None, ge=1, description="None: one pass over the validation split")
    base: bool = Field(default=True, description="also evaluate the convert stage's output (when it fits)")
    nproc_per_node: int = Field(default=2, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    grace_seconds: float = Field(default=10.0, gt=0, description="after SIGTERM on cancel, before SIGKILL")
    output: Path | None = Field(default=None, description="default: <workdir>/evaluation")
    retries: int = Field(default=0, ge=0)
    retry_delay_seconds: float = Field(default=10.0, ge=0)

    def key_config(self, seq_len: int) -> dict[str, Any]:
        return {"seq_len": seq_len, "rows_per_step": self.rows_per_step, "steps": self.steps, "base": self.base}


@dataclass(frozen=True, kw_only=True)
class EvaluateInputs:
    """Where the earlier stages put what this one reads."""

    validation_shards: Path
    data_manifest: Path  # the data-prep stage's output directory (its manifest names the tokenizer's size)
    pretrain_output: Path
    pretrain_model: AnyModelConfig
    pretrain_seq_len: int
    convert_output: Path


@dataclass(frozen=True, kw_only=True)
class EvaluatePlan:
    config: EvaluateStageConfig
    inputs: EvaluateInputs
    output: Path
    seq_len: int
    candidates: tuple[EvaluateCandidate, ...]
    notes: tuple[str, ...]
    key: StageKey


def base_candidate(inputs: EvaluateInputs) -> tuple[EvaluateCandidate | None, str]:
    """The convert output as a candidate, or None and why it cannot be evaluated on this data."""
    checkpoint = inputs.convert_output / "checkpoint"
    parameters_file = checkpoint / PARAMETERS_FILE
    if not parameters_file.is_file():
        return None, f"base not evaluated: {parameters_file} does not exist"
    raw = json.loads(parameters_file.read_text(encoding="utf-8"))
    decoder = inputs.pretrain_model.decoder
    model: AnyModelConfig
    if "num_experts" in raw:
        model = Qwen3MoeModelConfig(parameters=Qwen3MoeParameters.model_validate(raw), decoder=decoder)
    else:
        model = Qwen3DenseModelConfig(parameters=Qwen3DenseParameters.model_validate(raw), decoder=decoder)
    vocab = tokenizer_vocab_size(inputs.data_manifest)
    if vocab is not None and model.parameters.vocab_size < vocab:
        return None, (
            f"base not evaluated: the convert output's vocab_size={model.parameters.vocab_size} is smaller than "
            f"the tokenizer's {vocab} tokens"
        )
    return EvaluateCandidate(name="base", model=model, weights=checkpoint), f"base: the convert output {checkpoint}"


def tokenizer_vocab_size(data_output: Path) -> int | None:
    try:
        statistics = StageManifest.read(data_output).statistics
        return int(statistics["tokenizer"]["vocab_size"])
    except (ValueError, KeyError, TypeError):
        return None


def plan_evaluate(config: EvaluateStageConfig, inputs: EvaluateInputs, output: Path) -> EvaluatePlan:
    seq_len = config.seq_len or inputs.pretrain_seq_len
    pretrain = EvaluateCandidate(
        name="pretrain", model=inputs.pretrain_model, checkpoint=inputs.pretrain_output / CHECKPOINTS_DIR
    )
    candidates = [pretrain]
    notes = [f"pretrain: the newest complete checkpoint under {pretrain.checkpoint}"]
    fingerprints = [
        FileFingerprint.of(path, name=f"validation/{path.relative_to(inputs.validation_shards)}")
        for path in sorted(inputs.validation_shards.rglob("*"))
        if path.is_file()
    ]
    # A stage's manifest stands for its whole output (it holds every file's checksum).
    fingerprints.append(FileFingerprint.of(inputs.pretrain_output / MANIFEST_FILENAME, name="pretrain/manifest"))
    if config.base:
        base, note = base_candidate(inputs)
        notes.append(note)
        if base is not None:
            candidates.append(base)
            fingerprints.append(FileFingerprint.of(inputs.convert_output / MANIFEST_FILENAME, name="base/manifest"))
    key = StageKey(
        stage=STAGE_NAME, stage_version=STAGE_VERSION, config=config.key_config(seq_len), inputs=tuple(fingerprints)
    )
    return EvaluatePlan(
        config=config,
        inputs=inputs,
        output=output,
        seq_len=seq_len,
        candidates=tuple(candidates),
        notes=tuple(notes),
        key=key,
    )


def run_evaluate_stage(plan: EvaluatePlan, partial: PartialStage, progress: Progress) -> dict[str, Any]:
    """Evaluate every candidate in one launch, then write the reports and the loss curve into `partial`."""
    suite = EvaluateSuiteConfig(
        candidates=list(plan.candidates),
        shards=plan.inputs.validation_shards,
        seq_len=plan.seq_len,
        rows_per_step=plan.config.rows_per_step,
        steps=plan.config.steps,
        output=partial.root,
        device=plan.config.device,
    )
    suite_file = partial.root / SUITE_FILE
    suite_file.write_text(yaml.safe_dump(suite.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    progress.start("evaluate", float(len(plan.candidates)), "checkpoints")
    try:
        launch(
            LaunchSpec(
                module="d9d.flows.jobs.evaluate.program",
                args=["--suite", "--config", str(suite_file)],
                nproc_per_node=plan.config.nproc_per_node,
                log_file=partial.root / LOG_FILE,
                grace_seconds=plan.config.grace_seconds,
            ),
            on_progress=lambda record: progress.advance(1.0, Path(str(record.get("output", ""))).name),
        )
    finally:
        progress.finish()
    reports = {
        candidate.name: json.loads((partial.root / candidate.name / REPORT_JSON).read_text(encoding="utf-8"))
        for candidate in plan.candidates
    }
    notes = list(plan.notes)
    losses = read_losses(plan.inputs.pretrain_output / LOSSES_FILE)
    curve: str | None = LOSS_CURVE
    try:
        plot_loss_curve(losses, {name: report["loss"] for name, report in reports.items()}, partial.root / LOSS_CURVE)
    except PlotUnavailable as error:
        curve = None
        notes.append(f"no loss curve: {error}")
    summary = {"checkpoints": reports, "notes": notes, "loss_curve": curve, "validation_tokens": _tokens(reports)}
    (partial.root / REPORT_JSON).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (partial.root / REPORT_MARKDOWN).write_text(report_markdown(reports, notes), encoding="utf-8")
    return summary


def _tokens(reports: dict[str, dict[str, Any]]) -> int:
    return max((int(report["tokens"]) for report in reports.values()), default=0)


def report_markdown(reports: dict[str, dict[str, Any]], notes: list[str]) -> str:
    lines = [
        "# Evaluation",
        "",
        "| checkpoint | loss | perplexity | bits per byte | tokens |",
        "|---|---|---|---|---|",
    ]
    for name, report in reports.items():
        lines.append(
            f"| {name} | {report['loss']:.4f} | {report['perplexity']:.2f} | {report['bits_per_byte']:.4f} "
            f"| {report['tokens']:,} |"
        )
    lines += ["", *[f"- {note}" for note in notes], ""]
    return "\n".join(lines)


def table_rows(statistics: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpoint, for a table artifact."""
    return [
        {
            "checkpoint": name,
            "loss": round(float(report["loss"]), 4),
            "perplexity": round(float(report["perplexity"]), 2),
            "bits_per_byte": round(float(report["bits_per_byte"]), 4),
            "tokens": int(report["tokens"]),
            "path": report["checkpoint"],
        }
        for name, report in statistics.get("checkpoints", {}).items()
    ]


def commit(
    directory: StageDirectory, partial: PartialStage, plan: EvaluatePlan, statistics: dict[str, Any]
) -> StageResult:
    files = [SUITE_FILE, LOG_FILE, REPORT_JSON, REPORT_MARKDOWN]
    if statistics.get("loss_curve"):
        files.append(LOSS_CURVE)
    for candidate in plan.candidates:
        files += [f"{candidate.name}/{REPORT_JSON}", f"{candidate.name}/{REPORT_MARKDOWN}"]
    manifest = directory.commit(
        partial,
        plan.key,
        outputs=files,
        packages=package_versions(RECORDED_PACKAGES),
        statistics=statistics,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    return result_of(plan.output, "ran", "", manifest.statistics)


def skipped(plan: EvaluatePlan, completeness: Completeness) -> StageResult:
    assert completeness.manifest is not None
    return result_of(plan.output, "skipped", f"up to date: {completeness.reason}", completeness.manifest.statistics)


def result_of(output: Path, status: StageStatus, reason: str, statistics: dict[str, Any]) -> StageResult:
    artifacts = {"report": str(output / REPORT_MARKDOWN)}
    if statistics.get("loss_curve"):
        artifacts["loss curve"] = str(output / LOSS_CURVE)
    return StageResult(
        stage=STAGE_NAME,
        status=status,
        reason=reason,
        output=str(output),
        manifest=str(output / MANIFEST_FILENAME),
        artifacts=artifacts,
        statistics=dict(statistics),
    )
