"""The convert stage under the stage contract: plan (key from the mapping and the source's checksums), skip when
the manifest matches, else convert into the partial directory and commit. No Prefect here."""

from __future__ import annotations

import json
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
from d9d.flows.jobs.convert.config import ConvertConfig
from d9d.flows.jobs.progress import NoProgress, Progress
from d9d.flows.jobs.stage_spec import PreflightError, StageSpec
from d9d.models.conversions import named_mapping
from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.random_checkpoint import TINY_QWEN3_MOE, write_random_hf_checkpoint
from d9d.states import convert_checkpoint

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig

STAGE_NAME = "convert"
STAGE_VERSION = 1
CHECKPOINT_DIR = "checkpoint"
RECORDED_PACKAGES = ("d9d-core", "d9d-states", "d9d-models", "d9d-flows", "safetensors", "torch")
RANDOM_SOURCE_RECORD = ".random-source.json"  # what the random source was written from (hidden: not a key input)


@dataclass(frozen=True, kw_only=True)
class ConvertPlan:
    config: ConvertConfig
    mapping: str
    source: Path
    output: Path
    key: StageKey


def mapping_of(config: ConvertConfig, architecture: Qwen3DenseParameters) -> str:
    """The configured mapping, or the HF -> d9d mapping of the random source's family."""
    if config.mapping is not None:
        return config.mapping
    return "qwen3-moe-hf-to-d9d" if isinstance(architecture, Qwen3MoeParameters) else "qwen3-hf-to-d9d"


def source_of(config: ConvertConfig, output: Path) -> Path:
    """The checkpoint the stage reads: `config.source`, or the random one written next to the output."""
    return config.source if config.source is not None else output.parent / f"{output.name}-random-hf-source"


def prepare_source(
    config: ConvertConfig,
    output: Path,
    progress: Progress,
    *,
    architecture: Qwen3DenseParameters = TINY_QWEN3_MOE,
) -> Path:
    """The source directory; without a configured source, a random checkpoint of `architecture` (a Qwen3 dense or
    MoE), written again whenever the architecture or the seed differ from the one already there."""
    source = source_of(config, output)
    if config.source is None:
        wanted = {
            "seed": config.seed,
            "family": "qwen3_moe" if isinstance(architecture, Qwen3MoeParameters) else "qwen3_dense",
            "parameters": architecture.model_dump(mode="json"),
        }
        record = source / RANDOM_SOURCE_RECORD
        current = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None
        if current != wanted or not (source / "config.json").is_file():
            progress.note(
                f"convert: writing a random {wanted['family']} (hidden_size={architecture.hidden_size}, "
                f"vocab_size={architecture.vocab_size}, seed {config.seed}) in the HF layout to {source}"
            )
            write_random_hf_checkpoint(source, architecture, seed=config.seed, overwrite=True)
            record.write_text(json.dumps(wanted, indent=2) + "\n", encoding="utf-8")
    if not source.is_dir():
        raise FileNotFoundError(f"convert: the source checkpoint {source} is not a directory")
    return source


def plan_convert(
    config: ConvertConfig, output: Path, source: Path, *, architecture: Qwen3DenseParameters = TINY_QWEN3_MOE
) -> ConvertPlan:
    inputs = tuple(FileFingerprint.of_tree(source, hidden=False))
    mapping = mapping_of(config, architecture)
    key_config = {"mapping": mapping, "max_shard_bytes": config.max_shard_bytes}
    key = StageKey(stage=STAGE_NAME, stage_version=STAGE_VERSION, config=key_config, inputs=inputs)
    return ConvertPlan(config=config, mapping=mapping, source=source, output=output, key=key)


def run_convert(plan: ConvertPlan, partial: PartialStage) -> tuple[list[str], dict[str, Any]]:
    """Convert into `partial/checkpoint`; returns the output files (relative to the partial root) and statistics."""
    mapping = named_mapping(plan.mapping)
    destination = partial.root / CHECKPOINT_DIR
    report = convert_checkpoint(
        plan.source, destination, mapping.factory, max_shard_bytes=plan.config.max_shard_bytes, overwrite=True
    )
    mapping.convert_config(plan.source, destination, None)
    files = sorted(partial.files_in(CHECKPOINT_DIR))
    statistics = {
        "mapping": plan.mapping,
        "files": len(report.files),
        "groups": report.groups,
        "bytes_read": report.bytes_read,
        "bytes_written": report.bytes_written,
        "largest_group_bytes": report.largest_group_bytes,
        "seconds": round(report.seconds, 3),
    }
    return files, statistics


REPORTER = StageReporter(STAGE_NAME, RECORDED_PACKAGES, lambda output, _: {"checkpoint": str(output / CHECKPOINT_DIR)})


def commit(
    directory: StageDirectory, partial: PartialStage, plan: ConvertPlan, files: list[str], statistics: dict[str, Any]
) -> StageResult:
    return REPORTER.commit(directory, partial, plan.key, plan.output, outputs=files, statistics=statistics)


def skipped(plan: ConvertPlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)


def convert_model(
    config: ConvertConfig,
    output: Path,
    *,
    architecture: Qwen3DenseParameters = TINY_QWEN3_MOE,
    progress: Progress | None = None,
    replace: bool = False,
) -> StageResult:
    """The whole stage in this process, without an orchestrator: skip when complete, else convert and commit
    (`replace`: replace a foreign or stale `output` instead of refusing, see `StageDirectory`)."""
    progress = progress or NoProgress()
    directory = StageDirectory(output, replace=replace)
    with directory.lock():
        source = prepare_source(config, output, progress, architecture=architecture)
        plan = plan_convert(config, output, source, architecture=architecture)
        completeness = directory.check(plan.key)
        if completeness.complete:
            return skipped(plan, completeness)
        partial = directory.open_partial(plan.key)
        files, statistics = run_convert(plan, partial)
        result = commit(directory, partial, plan, files, statistics)
    return result.with_reason(completeness.reason)


def _plan(config: JobConfig, progress: Progress) -> ConvertPlan:
    """Without a source, a random checkpoint of the pretrain section's architecture (so pretraining starts from
    the converted weights); then the plan over the source's files."""
    output, architecture = config.convert_output, config.pretrain.model.parameters
    source = prepare_source(config.convert, output, progress, architecture=architecture)
    return plan_convert(config.convert, output, source, architecture=architecture)


def preflight(config: JobConfig) -> None:
    source = config.convert.source
    if source is not None and not source.is_dir():
        raise PreflightError(
            f"convert.source={source} is not a checkpoint directory; point it at a directory of *.safetensors "
            "files, or leave it unset to convert a random model of pretrain.model's shape."
        )


def _run(plan: ConvertPlan, directory: StageDirectory, progress: Progress) -> StageResult:
    partial = directory.open_partial(plan.key)
    files, statistics = run_convert(plan, partial)
    return commit(directory, partial, plan, files, statistics)


SPEC: StageSpec[ConvertPlan] = StageSpec(
    name=STAGE_NAME,
    section="convert",
    summary="a checkpoint through a named mapping into <workdir>/model (a random one of pretrain.model's shape "
    "when no source is set)",
    reads=lambda config: {},
    output=lambda config: config.convert_output,
    preflight=preflight,
    plan=_plan,
    describe=lambda plan: f"running {plan.mapping} on {plan.source}",
    run=_run,
    skipped=skipped,
)
