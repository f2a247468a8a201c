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
from typing import TYPE_CHECKING, Any

from d9d.flows.jobs.contract import (
    Completeness,
    FileFingerprint,
    PartialStage,
    StageDirectory,
    StageKey,
    StageReporter,
    StageResult,
)
from d9d.flows.jobs.data_prep.config import TrainBpeTokenizer
from d9d.flows.jobs.pretrain.config import PretrainRankConfig, PretrainStageConfig
from d9d.flows.jobs.progress import Progress
from d9d.flows.jobs.stage_spec import PreflightError, StageSpec
from d9d.flows.jobs.torchrun_stage import JOB_FILE, LOG_FILE, LOSSES_FILE, launch_training
from d9d.metrics.trackers import AnyTrackerConfig
from d9d.metrics.trackers.config import (
    AimTrackerConfig,
    JsonlTrackerConfig,
    NoTrackerConfig,
    TensorBoardTrackerConfig,
    WandbTrackerConfig,
)
from d9d.models.catalogue import PARAMETERS_FILE, model_kind, read_parameters

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig

STAGE_NAME = "pretrain"
STAGE_VERSION = 1
RECORDED_PACKAGES = ("d9d-core", "d9d-models", "d9d-parallel", "d9d-flows", "torch")
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"  # the trained model, self-describing: `d9d convert --mapping qwen3-d9d-to-hf` of it loads in HF
TRACKER_DIR = "tracker"
RUN_KEY_FILE = "run-key.json"


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
    theirs = read_parameters(convert_checkpoint)
    ours = config.model.parameters
    if model_kind(theirs) != config.model.kind or theirs != ours:
        return None, (
            f"random initialisation (the convert output is a {model_kind(theirs)} with vocab_size={theirs.vocab_size}, "
            f"hidden_size={theirs.hidden_size}; pretrain.model is a {config.model.kind} with "
            f"vocab_size={ours.vocab_size}, hidden_size={ours.hidden_size})"
        )
    return convert_checkpoint, f"the convert output {convert_checkpoint}"


def plan_pretrain(
    config: PretrainStageConfig, output: Path, train_shards: Path, convert_checkpoint: Path
) -> PretrainPlan:
    init_from, init_note = init_checkpoint(config, convert_checkpoint)
    inputs = FileFingerprint.of_tree(train_shards, prefix="train/")
    if init_from is not None:
        inputs += FileFingerprint.of_tree(init_from, prefix="init/")
    key = StageKey(stage=STAGE_NAME, stage_version=STAGE_VERSION, config=config.key_config(), inputs=tuple(inputs))
    return PretrainPlan(
        config=config, train_shards=train_shards, output=output, init_from=init_from, init_note=init_note, key=key
    )


def rank_config(plan: PretrainPlan, checkpoints: Path) -> PretrainRankConfig:
    """The rank program's config for this plan: the section unchanged, checkpointing into `checkpoints`."""
    return PretrainRankConfig(
        stage=plan.config,
        train_shards=plan.train_shards,
        checkpoints=checkpoints,
        init_weights=plan.init_from,
        # At pp > 1 the writer gathers every stage's tensors onto pipeline rank 0 (design 0015).
        model_output=checkpoints.parent / MODEL_DIR,
        tracker=tracker_config(plan.config.tracker, checkpoints.parent),
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
        for name in (CHECKPOINTS_DIR, LOSSES_FILE, MODEL_DIR):
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
        "model": MODEL_DIR,
        "resumed_from": run.resumed_from,
        "seconds": run.seconds(),
    }


def _artifacts(output: Path, statistics: Mapping[str, Any]) -> dict[str, str]:
    artifacts = {"model": model_artifact(output, statistics), "checkpoints": str(output / CHECKPOINTS_DIR)}
    return {**artifacts, "losses": str(output / LOSSES_FILE), **tracker_artifact(statistics)}


def model_artifact(output: Path, statistics: Mapping[str, Any]) -> str:
    """The trained model directory. An output committed before the stage exported one, or (`"model": None`) before
    it exported a pipelined one, says how to get it: its key is the same (neither the degrees nor the export are in
    it), so it stays finished."""
    if statistics.get("model"):
        return str(output / str(statistics["model"]))
    again = f"to get {output / MODEL_DIR}, delete {output} and run the stage again (its training repeats)"
    if "model" in statistics:
        return (
            f"none: this output was trained with pipeline parallelism before the pretrain stage exported pipelined "
            f"models; the model is in {output / CHECKPOINTS_DIR} (its newest step); {again}"
        )
    return f"none: this output was written before the pretrain stage exported its model; {again}"


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
    files = [JOB_FILE, LOSSES_FILE, LOG_FILE, *partial.files_in(CHECKPOINTS_DIR, TRACKER_DIR, MODEL_DIR)]
    return REPORTER.commit(directory, partial, plan.key, plan.output, outputs=files, statistics=statistics)


def skipped(plan: PretrainPlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)


def preflight(config: JobConfig) -> None:
    section = config.pretrain
    parameters = section.model.parameters
    tokenizer = config.data_prep.tokenizer
    vocab = tokenizer.vocab_size if isinstance(tokenizer, TrainBpeTokenizer) else None
    if vocab is not None and parameters.vocab_size < vocab:
        raise PreflightError(
            f"pretrain.model.parameters.vocab_size={parameters.vocab_size} is smaller than "
            f"data_prep.tokenizer.vocab_size={vocab}; token ids would fall outside the embedding table; set it to "
            f"at least {vocab}"
        )
    if section.seq_len > parameters.max_position_embeddings:
        raise PreflightError(
            f"pretrain.seq_len={section.seq_len} exceeds pretrain.model.parameters.max_position_embeddings="
            f"{parameters.max_position_embeddings}; lower seq_len or raise max_position_embeddings"
        )
    section.check_topology("pretrain", section.model, seq_len=section.seq_len)
    section.check_batch("pretrain")
    section.check_schedule("pretrain")


def _plan(config: JobConfig, progress: Progress) -> PretrainPlan:
    return plan_pretrain(
        config.pretrain,
        config.pretrain_output,
        train_shards=config.data_prep_output / "train",
        convert_checkpoint=config.convert_output / "checkpoint",
    )


def _run(plan: PretrainPlan, directory: StageDirectory, progress: Progress) -> StageResult:
    partial = directory.open_partial(plan.key)
    progress.note(f"pretrain: {prepare_partial(partial, plan.key)} on {plan.config.nproc_per_node} ranks")
    return commit(directory, partial, plan, run_pretrain_stage(plan, partial, progress))


SPEC: StageSpec[PretrainPlan] = StageSpec(
    name=STAGE_NAME,
    section="pretrain",
    summary="train the job's model on the train split into <workdir>/pretrain (job checkpoints, losses, the log)",
    reads=lambda config: {"data-prep": config.data_prep_output},
    output=lambda config: config.pretrain_output,
    preflight=preflight,
    plan=_plan,
    describe=lambda plan: f"running; starts from {plan.init_note}",
    run=_run,
    skipped=skipped,
)
