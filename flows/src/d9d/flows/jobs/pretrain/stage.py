"""The pretrain stage under the stage contract: the rank program under `torchrun`, resumable, committed once done.

Inputs are the data-prep stage's train split and, when `init_from="convert"` and the shapes agree, the convert
stage's checkpoint. The job checkpoints live in the stage's partial directory while it runs, so a cancelled or
failed attempt leaves them there and the next attempt (a Prefect retry, or the same command again) resumes from
the newest complete one; a changed config clears them first. No Prefect here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field

from d9d.flows.jobs.contract import (
    Completeness,
    FileFingerprint,
    PartialStage,
    StageDirectory,
    StageKey,
    StageReporter,
    StageResult,
)
from d9d.flows.jobs.pretrain.config import AnyModelConfig, PretrainConfig, PretrainDataConfig, Qwen3DenseModelConfig
from d9d.flows.jobs.progress import Progress
from d9d.flows.jobs.torchrun_stage import (
    JOB_FILE,
    LOG_FILE,
    LOSSES_FILE,
    TrainingLoopSettings,
    launch_training,
)
from d9d.metrics.trackers import AnyTrackerConfig
from d9d.metrics.trackers.config import (
    AimTrackerConfig,
    JsonlTrackerConfig,
    NoTrackerConfig,
    TensorBoardTrackerConfig,
    WandbTrackerConfig,
)
from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeParameters

STAGE_NAME = "pretrain"
STAGE_VERSION = 1
RECORDED_PACKAGES = ("d9d-core", "d9d-models", "d9d-parallel", "d9d-flows", "torch")
CHECKPOINTS_DIR = "checkpoints"
TRACKER_DIR = "tracker"
RUN_KEY_FILE = "run-key.json"
PARAMETERS_FILE = "parameters.json"  # written next to a converted checkpoint by the convert stage

DEFAULT_MODEL = Qwen3DenseModelConfig(
    parameters=Qwen3DenseParameters(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )
)  # fmt: skip


class PretrainStageConfig(TrainingLoopSettings):
    """The `pretrain` section of a job: the model and how long and how wide to train it.

    `init_from="convert"` starts from the convert stage's checkpoint when its parameters equal `model.parameters`
    (same family and shapes); otherwise, and with `"random"`, the model starts from its seeded initialisation.
    The stage records which one it used.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: AnyModelConfig = Field(default=DEFAULT_MODEL)
    seq_len: int = Field(default=128, gt=0, description="tokens per packed row")
    init_from: Literal["convert", "random"] = "convert"


@dataclass(frozen=True, kw_only=True)
class PretrainPlan:
    config: PretrainStageConfig
    train_shards: Path
    output: Path
    init_from: Path | None
    init_note: str
    key: StageKey


def init_checkpoint(config: PretrainStageConfig, convert_checkpoint: Path) -> tuple[Path | None, str]:
    """The checkpoint to start from and why: the convert output when its parameters equal the model's."""
    if config.init_from == "random":
        return None, "random initialisation (init_from=random)"
    parameters_file = convert_checkpoint / PARAMETERS_FILE
    if not parameters_file.is_file():
        return None, f"random initialisation ({parameters_file} does not exist)"
    raw = json.loads(parameters_file.read_text(encoding="utf-8"))
    theirs: Qwen3DenseParameters
    family = "qwen3_moe" if "num_experts" in raw else "qwen3_dense"
    theirs = (
        Qwen3MoeParameters.model_validate(raw) if family == "qwen3_moe" else Qwen3DenseParameters.model_validate(raw)
    )
    ours = config.model.parameters
    if family != config.model.kind or theirs != ours:
        return None, (
            f"random initialisation (the convert output is a {family} with vocab_size={theirs.vocab_size}, "
            f"hidden_size={theirs.hidden_size}; pretrain.model is a {config.model.kind} with "
            f"vocab_size={ours.vocab_size}, hidden_size={ours.hidden_size})"
        )
    return convert_checkpoint, f"the convert output {convert_checkpoint}"


def plan_pretrain(
    config: PretrainStageConfig, output: Path, train_shards: Path, convert_checkpoint: Path
) -> PretrainPlan:
    init_from, init_note = init_checkpoint(config, convert_checkpoint)
    inputs = [
        FileFingerprint.of(path, name=f"train/{path.relative_to(train_shards)}")
        for path in sorted(train_shards.rglob("*"))
        if path.is_file()
    ]
    if init_from is not None:
        inputs += [
            FileFingerprint.of(path, name=f"init/{path.relative_to(init_from)}")
            for path in sorted(init_from.rglob("*"))
            if path.is_file()
        ]
    key = StageKey(stage=STAGE_NAME, stage_version=STAGE_VERSION, config=config.key_config(), inputs=tuple(inputs))
    return PretrainPlan(
        config=config, train_shards=train_shards, output=output, init_from=init_from, init_note=init_note, key=key
    )


def rank_config(plan: PretrainPlan, checkpoints: Path) -> PretrainConfig:
    """The rank program's config for this plan, checkpointing into `checkpoints`."""
    config = plan.config
    return PretrainConfig(
        model=config.model,
        data=PretrainDataConfig(shards=plan.train_shards, seq_len=config.seq_len, shuffle_seed=config.shuffle_seed),
        trainer=config.trainer_config(checkpoints),
        degrees=config.degrees,
        data_parallel=config.data_parallel,
        optimizer=config.optimizer,
        lr_schedule=config.lr_schedule,
        init_from=plan.init_from,
        device=config.device,
        tracker=tracker_config(config.tracker, checkpoints.parent),
    )


def tracker_config(configured: AnyTrackerConfig | None, root: Path) -> AnyTrackerConfig:
    """The configured tracker, or the default: JSONL files in `root/tracker` (they move with the stage output)."""
    return configured if configured is not None else JsonlTrackerConfig(directory=root / TRACKER_DIR)


def tracker_run(configured: AnyTrackerConfig | None, partial: Path, output: Path) -> dict[str, str]:
    """The tracker run: its kind, its id (from the newest checkpoint in `partial`), where it is once committed."""
    tracker = tracker_config(configured, output)
    checkpoints = sorted((partial / CHECKPOINTS_DIR).glob("step-*/trainer_state.json"))
    run_id = str(json.loads(checkpoints[-1].read_text(encoding="utf-8")).get("tracker_run_id")) if checkpoints else ""
    return {"kind": tracker.kind, "run_id": run_id, "location": tracker_location(tracker, run_id)}


def tracker_location(tracker: AnyTrackerConfig, run_id: str) -> str:
    """Where run `run_id` of `tracker` is: its file or folder, or the aim experiment / wandb directory it joins."""
    match tracker:
        case JsonlTrackerConfig():
            return str(tracker.directory / f"{run_id}.jsonl")
        case TensorBoardTrackerConfig():
            return str(tracker.directory / run_id)
        case AimTrackerConfig():
            return f"aim repository {tracker.repo}, experiment {tracker.experiment}"
        case WandbTrackerConfig():
            return f"wandb {tracker.mode} run in {tracker.directory / 'wandb'}"
        case NoTrackerConfig():
            return "none"


def prepare_partial(partial: PartialStage, key: StageKey) -> str:
    """Keep the partial directory's checkpoints when they were made for this key; clear them otherwise."""
    record = partial.root / RUN_KEY_FILE
    try:
        previous = json.loads(record.read_text(encoding="utf-8"))["key"]
    except (OSError, ValueError, KeyError):
        previous = None
    checkpoints = partial.root / CHECKPOINTS_DIR
    if previous != key.digest:
        for name in (CHECKPOINTS_DIR, LOSSES_FILE):
            path = partial.root / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        record.write_text(json.dumps({"key": key.digest}), encoding="utf-8")
        return "a fresh run"
    found = sorted(checkpoints.glob("step-*/COMPLETE")) if checkpoints.is_dir() else []
    return f"resuming from {found[-1].parent.name}" if found else "a fresh run (no complete checkpoint yet)"


def run_pretrain_stage(plan: PretrainPlan, partial: PartialStage, progress: Progress) -> dict[str, Any]:
    """Launch the rank program on `nproc_per_node` ranks; returns the run's statistics."""
    config = plan.config
    job = rank_config(plan, partial.root / CHECKPOINTS_DIR)
    run = launch_training("d9d.flows.jobs.pretrain.program", job, config, partial.root, progress, name=STAGE_NAME)
    losses = run.losses
    if not losses or max(losses) != config.steps:
        raise RuntimeError(
            f"pretrain: the rank program exited before step {config.steps} (last: {max(losses, default=0)}); "
            f"see {partial.root / LOG_FILE}"
        )
    return {
        "steps": config.steps,
        "final_loss": losses[config.steps],
        "tracker": tracker_run(config.tracker, partial.root, plan.output),
        "ranks": config.nproc_per_node,
        "init": plan.init_note,
        "resumed_from": run.resumed_from,
        "seconds": run.seconds(),
    }


def _artifacts(output: Path, statistics: Mapping[str, Any]) -> dict[str, str]:
    artifacts = {"checkpoints": str(output / CHECKPOINTS_DIR), "losses": str(output / LOSSES_FILE)}
    return {**artifacts, **tracker_artifact(statistics)}


def tracker_artifact(statistics: Mapping[str, Any]) -> dict[str, str]:
    """The training run's tracker run (kind, id, where), for the summary; nothing without a tracker."""
    tracker = statistics.get("tracker")
    if isinstance(tracker, dict) and tracker.get("kind") != "none":
        return {"tracker run": f"{tracker['kind']} {tracker['run_id']}: {tracker['location']}"}
    return {}


REPORTER = StageReporter(STAGE_NAME, RECORDED_PACKAGES, _artifacts)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: PretrainPlan, statistics: dict[str, Any]
) -> StageResult:
    checkpoints = partial.root / CHECKPOINTS_DIR
    files = [JOB_FILE, LOSSES_FILE, LOG_FILE]
    for folder in (checkpoints, partial.root / TRACKER_DIR):
        files += sorted(str(path.relative_to(partial.root)) for path in folder.rglob("*") if path.is_file())
    return REPORTER.commit(directory, partial, plan.key, plan.output, outputs=files, statistics=statistics)


def skipped(plan: PretrainPlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)
