"""The fine-tune stage under the stage contract: the fine-tune rank program under `torchrun`, resumable, committed.

Inputs are the base (the pretrain stage's newest complete job checkpoint, or `finetune.base`: safetensors in d9d's
layout or read through `finetune.base_mapping`, e.g. a Hugging Face directory) and the finetune-data stage's train
and validation splits. The model is the pretrain section's, or the one the base describes; `seq_len` is the
pretrain section's. The adapter-only job checkpoints live in the partial directory while the stage runs, so a
cancelled or failed attempt resumes from the newest one (the base is loaded first); a changed config clears them.
The rank program writes `adapter/`, `merged/` (the adapters folded into the base, d9d-layout safetensors with its
`parameters.json`, what the evaluate stage reads), `peft.json` and `finetune.json`. No Prefect here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from d9d.flows.jobs.finetune.config import FinetuneRankConfig, FinetuneStageConfig
from d9d.flows.jobs.finetune.program import ADAPTER_DIR, MERGED_DIR, PEFT_FILE, REPORT_FILE
from d9d.flows.jobs.pretrain.stage import (
    CHECKPOINTS_DIR,
    TRACKER_DIR,
    prepare_partial,
    tracker_artifact,
    tracker_config,
    tracker_run,
)
from d9d.flows.jobs.progress import Progress
from d9d.flows.jobs.stage_spec import PreflightError, StageSpec
from d9d.flows.jobs.torchrun_stage import JOB_FILE, LOG_FILE, LOSSES_FILE, launch_training, model_key_config
from d9d.models.catalogue import AnyModelConfig, model_config_for, read_parameters
from d9d.models.conversions import named_mapping

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig

STAGE_NAME = "finetune"
STAGE_VERSION = 1
RECORDED_PACKAGES = ("d9d-core", "d9d-models", "d9d-parallel", "d9d-peft", "d9d-flows", "torch")


@dataclass(frozen=True, kw_only=True)
class FinetuneInputs:
    """Where the earlier stages (or the user) put what this one reads, and the model to build."""

    model: AnyModelConfig
    seq_len: int
    base: Path  # a job checkpoint directory (pretrain's) or a safetensors checkpoint
    base_manifest: Path | None  # the pretrain stage's output when the base is its checkpoints
    data_output: Path  # the finetune-data stage's output (train/ and validation/)


@dataclass(frozen=True, kw_only=True)
class FinetunePlan:
    config: FinetuneStageConfig
    inputs: FinetuneInputs
    output: Path
    key: StageKey


def inputs_of(config: JobConfig) -> FinetuneInputs:
    """The base, the model and the data of the job's fine-tune stage."""
    section, pretrain = config.finetune, config.pretrain
    if section.base is None:
        return FinetuneInputs(
            model=pretrain.model,
            seq_len=pretrain.seq_len,
            base=config.pretrain_output / CHECKPOINTS_DIR,
            base_manifest=config.pretrain_output,
            data_output=config.finetune_data_output,
        )
    return FinetuneInputs(
        model=base_model(section, decoder_of=pretrain.model),
        seq_len=pretrain.seq_len,
        base=section.base,
        base_manifest=None,
        data_output=config.finetune_data_output,
    )


def base_model(section: FinetuneStageConfig, *, decoder_of: AnyModelConfig) -> AnyModelConfig:
    """The model `finetune.base` holds: from its `parameters.json`, or its own config read through the mapping."""
    assert section.base is not None
    try:
        if section.base_mapping is not None:
            parameters = named_mapping(section.base_mapping).source_parameters(section.base)
        else:
            parameters = read_parameters(section.base)
    except (OSError, ValueError) as error:
        raise PreflightError(
            f"finetune.base={section.base}: cannot tell which model it holds ({error}); point it at a d9d model "
            "directory (with parameters.json) or set finetune.base_mapping (e.g. qwen3-hf-to-d9d for a Hugging "
            "Face directory with config.json)"
        ) from error
    return model_config_for(parameters, decoder_of.decoder)


def plan_finetune(config: FinetuneStageConfig, inputs: FinetuneInputs, output: Path) -> FinetunePlan:
    # A stage's manifest stands for its whole output (it holds every file's checksum).
    fingerprints = [FileFingerprint.of(inputs.data_output / MANIFEST_FILENAME, name="finetune-data/manifest")]
    if inputs.base_manifest is not None:
        fingerprints.insert(0, FileFingerprint.of(inputs.base_manifest / MANIFEST_FILENAME, name="pretrain/manifest"))
    else:
        fingerprints += FileFingerprint.of_tree(inputs.base, prefix="base/", hidden=False)
    key_config = {
        **config.key_config(),
        "model": model_key_config(inputs.model.model_dump(mode="json")),
        "seq_len": inputs.seq_len,
    }
    key = StageKey(stage=STAGE_NAME, stage_version=STAGE_VERSION, config=key_config, inputs=tuple(fingerprints))
    return FinetunePlan(config=config, inputs=inputs, output=output, key=key)


def rank_config(plan: FinetunePlan, root: Path) -> FinetuneRankConfig:
    """The rank program's config: the section unchanged, adapter-only job checkpoints under `root/checkpoints`,
    outputs into `root`."""
    inputs = plan.inputs
    return FinetuneRankConfig(
        stage=plan.config,
        model=inputs.model,
        seq_len=inputs.seq_len,
        base=inputs.base,
        train_shards=inputs.data_output / "train",
        validation_shards=inputs.data_output / "validation",
        checkpoints=root / CHECKPOINTS_DIR,
        output=root,
        tracker=tracker_config(plan.config.tracker, root),
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
        "adapter": str(output / ADAPTER_DIR),
        "checkpoints": str(output / CHECKPOINTS_DIR),
        "losses": str(output / LOSSES_FILE),
        **tracker_artifact(statistics),
    }


REPORTER = StageReporter(STAGE_NAME, RECORDED_PACKAGES, _artifacts)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: FinetunePlan, statistics: dict[str, Any]
) -> StageResult:
    files = [JOB_FILE, LOSSES_FILE, LOG_FILE, REPORT_FILE, PEFT_FILE]
    files += partial.files_in(CHECKPOINTS_DIR, TRACKER_DIR, ADAPTER_DIR, MERGED_DIR, "hf_peft")
    return REPORTER.commit(directory, partial, plan.key, plan.output, outputs=files, statistics=statistics)


def skipped(plan: FinetunePlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)


def preflight(config: JobConfig) -> None:
    section = config.finetune
    model = config.pretrain.model
    if section.base is not None:
        if not section.base.is_dir():
            raise PreflightError(f"finetune.base={section.base} is not a directory of safetensors files")
        model = base_model(section, decoder_of=config.pretrain.model)
    section.check_topology("finetune", model, seq_len=config.pretrain.seq_len)
    section.check_batch("finetune")
    section.check_schedule("finetune")
    dp = section.data_parallel_size()
    if dp is not None and section.validation_rows_per_step % dp:
        raise PreflightError(
            f"finetune.validation_rows_per_step={section.validation_rows_per_step} is not a multiple of the "
            f"data-parallel size {dp} (finetune.nproc_per_node={section.nproc_per_node}, "
            f"{section.resolved_degrees().describe()}); every data-parallel rank evaluates the same number of rows"
        )


def reads(config: JobConfig) -> dict[str, Path]:
    needs = {"finetune-data": config.finetune_data_output}
    if config.finetune.base is None:
        needs = {"pretrain": config.pretrain_output, **needs}
    return needs


def _run(plan: FinetunePlan, directory: StageDirectory, progress: Progress) -> StageResult:
    partial = directory.open_partial(plan.key)
    progress.note(f"finetune: {prepare_partial(partial, plan.key)} on {plan.config.nproc_per_node} ranks")
    return commit(directory, partial, plan, run_finetune_stage(plan, partial, progress))


SPEC: StageSpec[FinetunePlan] = StageSpec(
    name=STAGE_NAME,
    section="finetune",
    summary="fine-tune the base on the fine-tune corpus into <workdir>/finetune (adapter, merged weights)",
    reads=reads,
    output=lambda config: config.finetune_output,
    preflight=preflight,
    plan=lambda config, progress: plan_finetune(config.finetune, inputs_of(config), config.finetune_output),
    describe=lambda plan: f"running {plan.config.peft.kind} from {plan.inputs.base}",
    run=_run,
    skipped=skipped,
)
