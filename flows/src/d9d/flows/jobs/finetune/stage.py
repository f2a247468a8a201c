"""The fine-tune stage under the stage contract: the fine-tune rank program under `torchrun`, resumable, committed.

Inputs are the pretrain stage's newest complete job checkpoint (the base), and the finetune-data stage's train and
validation splits. The model and `seq_len` are the pretrain section's. The adapter-only job checkpoints live in the
partial directory while the stage runs, so a cancelled or failed attempt resumes from the newest one (the base is
loaded first); a changed config clears them. The rank program writes `adapter/`, `merged/` (the adapters folded
into the base, d9d-layout safetensors, what the evaluate stage reads), `peft.json` and `finetune.json` (validation
loss before and after). No Prefect here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from d9d.core.optim import AdamWConfig, AnyOptimizerConfig
from d9d.flows.jobs.contract import (
    MANIFEST_FILENAME,
    Completeness,
    FileFingerprint,
    PartialStage,
    StageDirectory,
    StageKey,
    StageReporter,
    StageResult,
)
from d9d.flows.jobs.finetune.config import FinetuneConfig, FinetuneValidationConfig
from d9d.flows.jobs.finetune.program import REPORT_FILE
from d9d.flows.jobs.pretrain.config import AnyModelConfig, PretrainDataConfig
from d9d.flows.jobs.pretrain.stage import CHECKPOINTS_DIR, TRACKER_DIR, tracker_artifact, tracker_config, tracker_run
from d9d.flows.jobs.progress import Progress
from d9d.flows.jobs.torchrun_stage import JOB_FILE, LOG_FILE, LOSSES_FILE, TrainingLoopSettings, launch_training
from d9d.peft import AnyPeftConfig
from d9d.peft.config import LoRAConfig, LoRAParameters

STAGE_NAME = "finetune"
STAGE_VERSION = 1
RECORDED_PACKAGES = ("d9d-core", "d9d-models", "d9d-parallel", "d9d-peft", "d9d-flows", "torch")
MERGED_DIR = "merged"

# LoRA on every attention and MLP projection of the Qwen3 blocks (dense MLPs and grouped experts alike).
DEFAULT_PEFT = LoRAConfig.model_validate(
    {
        "module_name_pattern": r".*\.self_attn\.(q|k|v|o)_proj|.*\.mlp\.(experts\.)?(gate|up|down)_proj",
        "params": LoRAParameters(r=8, alpha=16.0),
    }
)


class FinetuneStageConfig(TrainingLoopSettings):
    """The `finetune` section of a job: the PEFT method and how long and how wide to train it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peft: AnyPeftConfig = Field(default=DEFAULT_PEFT, description="LoRA (default), full_tune, or a stack of them")
    steps: int = Field(default=50, ge=1)
    checkpoint_every: int | None = Field(default=25, ge=1, description="None: at the end and on SIGTERM only")
    optimizer: AnyOptimizerConfig = Field(default_factory=lambda: AdamWConfig(lr=1e-3))
    validation_rows_per_step: int = Field(default=8, gt=0, description="finetune.json's before/after loss")
    validation_steps: int = Field(default=4, ge=1)

    @field_validator("peft", mode="before")
    @classmethod
    def _default_kind(cls, value: Any) -> Any:
        """A `peft` section without `kind` (e.g. `--set finetune.peft.params.r=4`) changes the default LoRA."""
        if isinstance(value, dict) and "kind" not in value:
            return {**DEFAULT_PEFT.model_dump(mode="json"), **value}
        return value


@dataclass(frozen=True, kw_only=True)
class FinetuneInputs:
    """Where the earlier stages put what this one reads, and the pretrain section's model."""

    model: AnyModelConfig
    seq_len: int
    pretrain_output: Path
    data_output: Path  # the finetune-data stage's output (train/ and validation/)


@dataclass(frozen=True, kw_only=True)
class FinetunePlan:
    config: FinetuneStageConfig
    inputs: FinetuneInputs
    output: Path
    key: StageKey


def plan_finetune(config: FinetuneStageConfig, inputs: FinetuneInputs, output: Path) -> FinetunePlan:
    # A stage's manifest stands for its whole output (it holds every file's checksum).
    fingerprints = [
        FileFingerprint.of(inputs.pretrain_output / MANIFEST_FILENAME, name="pretrain/manifest"),
        FileFingerprint.of(inputs.data_output / MANIFEST_FILENAME, name="finetune-data/manifest"),
    ]
    key_config = {
        **config.key_config(),
        "model": inputs.model.model_dump(mode="json"),
        "seq_len": inputs.seq_len,
    }
    key = StageKey(stage=STAGE_NAME, stage_version=STAGE_VERSION, config=key_config, inputs=tuple(fingerprints))
    return FinetunePlan(config=config, inputs=inputs, output=output, key=key)


def rank_config(plan: FinetunePlan, root: Path) -> FinetuneConfig:
    """The rank program's config: adapter-only job checkpoints under `root/checkpoints`, outputs into `root`."""
    config, inputs = plan.config, plan.inputs
    return FinetuneConfig(
        model=inputs.model,
        base=inputs.pretrain_output / CHECKPOINTS_DIR,
        peft=config.peft,
        data=PretrainDataConfig(
            shards=inputs.data_output / "train", seq_len=inputs.seq_len, shuffle_seed=config.shuffle_seed
        ),
        validation=FinetuneValidationConfig(
            shards=inputs.data_output / "validation",
            rows_per_step=config.validation_rows_per_step,
            steps=config.validation_steps,
        ),
        # The base is the pretrain stage's; only the adapters are new.
        trainer=config.trainer_config(root / CHECKPOINTS_DIR, trainable_only=True),
        output=root,
        degrees=config.degrees,
        data_parallel=config.data_parallel,
        optimizer=config.optimizer,
        lr_schedule=config.lr_schedule,
        device=config.device,
        tracker=tracker_config(config.tracker, root),
    )


def run_finetune_stage(plan: FinetunePlan, partial: PartialStage, progress: Progress) -> dict[str, Any]:
    """Launch the rank program on `nproc_per_node` ranks; returns the run's statistics."""
    config = plan.config
    job = rank_config(plan, partial.root)
    run = launch_training("d9d.flows.jobs.finetune.program", job, config, partial.root, progress, name=STAGE_NAME)
    losses = run.losses
    report_file = partial.root / REPORT_FILE
    if not losses or max(losses) != config.steps or not report_file.is_file():
        raise RuntimeError(
            f"finetune: the rank program exited before step {config.steps} and its export (last step: "
            f"{max(losses, default=0)}); see {partial.root / LOG_FILE}"
        )
    report = json.loads(report_file.read_text(encoding="utf-8"))
    return {
        "steps": config.steps,
        "final_loss": losses[config.steps],
        "method": config.peft.kind,
        "validation_loss_before": report["validation_loss_before"],
        "validation_loss_after": report["validation_loss_after"],
        "trainable_parameters": report["trainable_parameters"],
        "total_parameters": report["total_parameters"],
        "base": report["base"],
        "tracker": tracker_run(config.tracker, partial.root, plan.output),
        "ranks": config.nproc_per_node,
        "resumed_from": run.resumed_from,
        "seconds": run.seconds(),
    }


def _artifacts(output: Path, statistics: Mapping[str, Any]) -> dict[str, str]:
    return {
        "merged weights": str(output / MERGED_DIR),
        "adapter": str(output / "adapter"),
        "checkpoints": str(output / CHECKPOINTS_DIR),
        "losses": str(output / LOSSES_FILE),
        **tracker_artifact(statistics),
    }


REPORTER = StageReporter(STAGE_NAME, RECORDED_PACKAGES, _artifacts)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: FinetunePlan, statistics: dict[str, Any]
) -> StageResult:
    files = [JOB_FILE, LOSSES_FILE, LOG_FILE, REPORT_FILE, "peft.json"]
    for name in (CHECKPOINTS_DIR, TRACKER_DIR, "adapter", MERGED_DIR):
        folder = partial.root / name
        files += sorted(str(path.relative_to(partial.root)) for path in folder.rglob("*") if path.is_file())
    return REPORTER.commit(directory, partial, plan.key, plan.output, outputs=files, statistics=statistics)


def skipped(plan: FinetunePlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)
