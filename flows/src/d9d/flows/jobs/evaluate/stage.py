"""The evaluate stage under the stage contract: held-out loss, perplexity and bits per byte of each checkpoint on
each held-out split.

Checkpoints: `base` (the convert stage's output, when `base` is on and its vocabulary covers the tokenizer's: a
model whose embedding table is smaller than the token ids cannot read the data), `pretrain` (the newest complete
checkpoint of the pretrain stage) and `finetune` (the fine-tune stage's merged weights, when `finetune` is on).
Splits: `pretrain-data` (the data-prep stage's validation split) and `finetune-data` (the finetune-data stage's,
when `finetune` is on). Every checkpoint x split runs in one `torchrun` launch of the evaluate rank program. The
stage writes `evaluation.json`, `evaluation.md`, `loss_curve.png` (pretrain loss per step with each checkpoint's
held-out loss on the pretrain data) and `finetune_loss_curve.png` (the same for fine-tuning, on the fine-tune data).
Each checkpoint x split is also logged as a run of the pretrain stage's tracker family (`EvaluateInputs.tracker`:
the same JSONL/TensorBoard directory, aim experiment or wandb group), named `evaluate <checkpoint>.<split>`; the
statistics record those runs.

Per checkpoint (not per split), the same launch scores `evaluate.tasks` with lm_eval's own evaluator through d9d's
adapter (the project's local tasks are written into `tasks/` first, from the works the job's own data stages held
out) and continues `evaluate.prompts` greedily. `evaluation.md` puts every number side by side (`report.py`);
`evaluation.json` holds the same numbers, and `<output>-history/` keeps each committed one, so the next run shows its
deltas against the previous report (`history.py`). No Prefect here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from d9d.flows.jobs.contract import (
    MANIFEST_FILENAME,
    Completeness,
    FileFingerprint,
    PartialStage,
    StageDirectory,
    StageKey,
    StageManifest,
    StageReporter,
    StageResult,
)
from d9d.flows.jobs.data_prep.prepare import TOKENIZER_FILE
from d9d.flows.jobs.degree_checks import check_topology
from d9d.flows.jobs.evaluate.config import (
    DownstreamConfig,
    EvaluateCandidate,
    EvaluateStageConfig,
    EvaluateSuiteConfig,
)
from d9d.flows.jobs.evaluate.history import previous_report, read_report, record
from d9d.flows.jobs.evaluate.plot import PlotUnavailable, plot_loss_curve
from d9d.flows.jobs.evaluate.program import DOWNSTREAM_JSON
from d9d.flows.jobs.evaluate.report import (
    compare_reports,
    report_markdown,
    score_rows,
    table_rows,
)
from d9d.flows.jobs.evaluation_tasks import CORPORA, HeldOutSplit, write_local_tasks
from d9d.flows.jobs.launch import LaunchSpec
from d9d.flows.jobs.launchers import build_launcher
from d9d.flows.jobs.offload_checks import check_evaluation_offload
from d9d.flows.jobs.pretrain.stage import CHECKPOINTS_DIR, tracker_location
from d9d.flows.jobs.progress import Progress
from d9d.flows.jobs.rank_failure import rank_errors
from d9d.flows.jobs.stage_spec import Artifact, MarkdownArtifact, PreflightError, StageSpec, TableArtifact
from d9d.flows.jobs.torchrun_stage import LOSSES_FILE, read_losses
from d9d.metrics.trackers import AnyTrackerConfig, JsonlTrackerConfig, NoTrackerConfig, TensorBoardTrackerConfig
from d9d.models.catalogue import PARAMETERS_FILE, AnyModelConfig, model_config_for, read_parameters

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig

STAGE_NAME = "evaluate"
STAGE_VERSION = 3  # 2: checkpoints x splits, the fine-tuned checkpoint; 3: lm-eval tasks, samples, history
RECORDED_PACKAGES = ("d9d-core", "d9d-models", "d9d-flows", "torch")
SUITE_FILE = "suite.yaml"
LOG_FILE = "launch.log"
REPORT_JSON = "evaluation.json"
REPORT_MARKDOWN = "evaluation.md"
LOSS_CURVE = "loss_curve.png"
FINETUNE_LOSS_CURVE = "finetune_loss_curve.png"
PRETRAIN_SPLIT = "pretrain-data"
FINETUNE_SPLIT = "finetune-data"
MERGED_DIR = "merged"  # the fine-tune stage's merged weights (d9d-layout safetensors)
TASKS_DIR = "tasks"  # the local lm-eval tasks' data (JSON lines) and task YAMLs, written for this run
LOCAL_TASK_KINDS = ("next_line", "cloze")


@dataclass(frozen=True, kw_only=True)
class EvaluateInputs:
    """Where the earlier stages put what this one reads."""

    validation_shards: Path
    data_manifest: Path  # the data-prep stage's output directory (its manifest names the tokenizer's size)
    pretrain_output: Path
    pretrain_model: AnyModelConfig
    pretrain_seq_len: int
    convert_output: Path
    finetune_output: Path | None = None  # None: no fine-tuned checkpoint and no fine-tune split
    finetune_model: AnyModelConfig | None = None  # the fine-tuned model (None: the pretrain model)
    finetune_validation_shards: Path | None = None
    # The pretrain stage's tracker as it resolved it: evaluations join the training run's family. Not in the key.
    tracker: AnyTrackerConfig = field(default_factory=NoTrackerConfig)
    # Per embedded corpus a data stage of the job read: which of its works that stage held out. The local tasks of
    # that corpus are built from those works only (a corpus the job never read: the data-prep defaults).
    held_out: Mapping[str, HeldOutSplit] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EvaluatePlan:
    config: EvaluateStageConfig
    inputs: EvaluateInputs
    output: Path
    seq_len: int
    checkpoints: tuple[EvaluateCandidate, ...]  # one per model; its `shards` unset
    splits: dict[str, Path]  # split name -> validation shards
    notes: tuple[str, ...]
    key: StageKey

    @property
    def candidates(self) -> tuple[EvaluateCandidate, ...]:
        """Every checkpoint on every split, each reporting into `<checkpoint>.<split>/`; the first split's candidate
        of each checkpoint also scores the tasks and prompts (they do not depend on the split)."""
        first = next(iter(self.splits))
        return tuple(
            checkpoint.model_copy(
                update={"name": f"{checkpoint.name}.{split}", "shards": shards, "downstream": split == first}
            )
            for checkpoint in self.checkpoints
            for split, shards in self.splits.items()
        )


def base_candidate(inputs: EvaluateInputs) -> tuple[EvaluateCandidate | None, str]:
    """The convert output as a candidate, or None and why it cannot be evaluated on this data."""
    checkpoint = inputs.convert_output / "checkpoint"
    parameters_file = checkpoint / PARAMETERS_FILE
    if not parameters_file.is_file():
        return None, f"base not evaluated: {parameters_file} does not exist"
    model = model_config_for(read_parameters(checkpoint), inputs.pretrain_model.decoder)
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


def _shard_fingerprints(shards: Path, split: str) -> list[FileFingerprint]:
    return FileFingerprint.of_tree(shards, prefix=f"{split}/")


def plan_evaluate(config: EvaluateStageConfig, inputs: EvaluateInputs, output: Path) -> EvaluatePlan:
    seq_len = config.seq_len or inputs.pretrain_seq_len
    checkpoints: list[EvaluateCandidate] = []
    notes: list[str] = []
    splits = {PRETRAIN_SPLIT: inputs.validation_shards}
    # A stage's manifest stands for its whole output (it holds every file's checksum).
    fingerprints = _shard_fingerprints(inputs.validation_shards, PRETRAIN_SPLIT)
    if config.base:
        base, note = base_candidate(inputs)
        notes.append(note)
        if base is not None:
            checkpoints.append(base)
            fingerprints.append(FileFingerprint.of(inputs.convert_output / MANIFEST_FILENAME, name="base/manifest"))
    pretrain = EvaluateCandidate(
        name="pretrain", model=inputs.pretrain_model, checkpoint=inputs.pretrain_output / CHECKPOINTS_DIR
    )
    checkpoints.append(pretrain)
    notes.append(f"pretrain: the newest complete checkpoint under {pretrain.checkpoint}")
    fingerprints.append(FileFingerprint.of(inputs.pretrain_output / MANIFEST_FILENAME, name="pretrain/manifest"))
    if config.finetune and inputs.finetune_output is not None and inputs.finetune_validation_shards is not None:
        merged = inputs.finetune_output / MERGED_DIR
        model = inputs.finetune_model or inputs.pretrain_model
        checkpoints.append(EvaluateCandidate(name="finetune", model=model, weights=merged))
        notes.append(f"finetune: the fine-tune stage's merged weights {merged}")
        fingerprints.append(FileFingerprint.of(inputs.finetune_output / MANIFEST_FILENAME, name="finetune/manifest"))
        splits[FINETUNE_SPLIT] = inputs.finetune_validation_shards
        fingerprints += _shard_fingerprints(inputs.finetune_validation_shards, FINETUNE_SPLIT)
    key = StageKey(
        stage=STAGE_NAME, stage_version=STAGE_VERSION, config=config.key_config(seq_len), inputs=tuple(fingerprints)
    )
    return EvaluatePlan(
        config=config,
        inputs=inputs,
        output=output,
        seq_len=seq_len,
        checkpoints=tuple(checkpoints),
        splits=splits,
        notes=tuple(notes),
        key=key,
    )


def local_task_corpora(tasks: list[str]) -> list[str]:
    """The embedded corpora whose local tasks (`d9d_<kind>_<corpus>`) `tasks` names."""
    wanted = {f"d9d_{kind}_{corpus}": corpus for kind in LOCAL_TASK_KINDS for corpus in CORPORA}
    return sorted({wanted[task] for task in tasks if task in wanted})


def write_tasks(plan: EvaluatePlan, root: Path) -> Path | None:
    """The local tasks that `evaluate.tasks` names, from the works the job's data stages held out (None: none)."""
    corpora = local_task_corpora(plan.config.tasks)
    if not corpora:
        return None
    directory = root / TASKS_DIR
    for corpus in corpora:
        split = plan.inputs.held_out.get(corpus, HeldOutSplit())
        write_local_tasks(
            directory,
            corpora=[corpus],  # type: ignore[list-item]  # a CorpusName: local_task_corpora only returns those
            documents=plan.config.limit or 200,
            validation_fraction=split.validation_fraction,
            split_seed=split.seed,
            limit=split.limit,
        )
    return directory


def suite_config(plan: EvaluatePlan, root: Path, tasks_dir: Path | None = None) -> EvaluateSuiteConfig:
    """The rank program's config: every checkpoint on every split, reporting into `root/<checkpoint>.<split>/` and
    logging into the pretrain stage's tracker family; tasks (local ones from `tasks_dir`) and prompts per
    checkpoint."""
    config = plan.config
    downstream = None
    if config.tasks or config.prompts:
        downstream = DownstreamConfig(
            tokenizer=plan.inputs.data_manifest / TOKENIZER_FILE,
            tasks=config.tasks,
            tasks_dir=tasks_dir,
            limit=config.limit,
            batch_size=config.task_batch_size,
            max_length=plan.seq_len,
            prompts=config.prompts,
            max_new_tokens=config.max_new_tokens,
        )
    return EvaluateSuiteConfig(
        stage=config,
        candidates=list(plan.candidates),
        shards=plan.inputs.validation_shards,
        seq_len=plan.seq_len,
        output=root,
        tracker=plan.inputs.tracker,
        downstream=downstream,
    )


def run_evaluate_stage(plan: EvaluatePlan, partial: PartialStage, progress: Progress) -> dict[str, Any]:
    """Evaluate every checkpoint on every split in one launch, then write the reports and the loss curves."""
    candidates = plan.candidates
    suite = suite_config(plan, partial.root, write_tasks(plan, partial.root))
    suite_file = partial.root / SUITE_FILE
    suite_file.write_text(yaml.safe_dump(suite.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    run_ids: dict[str, str] = {}

    def evaluated(record: dict[str, Any]) -> None:
        name = Path(str(record.get("output", ""))).name
        run_ids[name] = str(record.get("tracker_run_id", ""))
        progress.advance(1.0, name)

    progress.start("evaluate", float(len(candidates)), "evaluations")
    log_file = partial.root / LOG_FILE
    failed = True
    try:
        with rank_errors(log_file, lambda cause: f"evaluate: a rank failed:\n{cause}"):
            build_launcher(plan.config.launcher, plan.config, name=STAGE_NAME).run(
                LaunchSpec(
                    module="d9d.flows.jobs.evaluate.program",
                    args=["--suite", "--config", str(suite_file)],
                    nproc_per_node=plan.config.nproc_per_node,
                    log_file=log_file,
                    grace_seconds=plan.config.grace_seconds,
                ),
                on_progress=evaluated,
                note=progress.note,
            )
        failed = False
    finally:
        progress.finish(failed=failed)
    reports: dict[str, dict[str, Any]] = {
        checkpoint.name: {
            split: json.loads((partial.root / f"{checkpoint.name}.{split}" / REPORT_JSON).read_text(encoding="utf-8"))
            for split in plan.splits
        }
        for checkpoint in plan.checkpoints
    }
    notes = list(plan.notes)
    curves = _draw_curves(plan, reports, partial.root, notes)
    first = next(iter(plan.splits))
    downstream = {
        checkpoint.name: json.loads((partial.root / f"{checkpoint.name}.{first}" / DOWNSTREAM_JSON).read_text("utf-8"))
        for checkpoint in plan.checkpoints
        if suite.downstream is not None
    }
    summary: dict[str, Any] = {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "checkpoints": reports,
        "tasks": {name: result["tasks"] for name, result in downstream.items()},
        "samples": {name: result["samples"] for name, result in downstream.items()},
        "max_new_tokens": plan.config.max_new_tokens,
        "splits": {split: str(shards) for split, shards in plan.splits.items()},
        "comparison": comparison(reports),
        "notes": notes,
        "loss_curves": curves,
        "validation_tokens": {split: _tokens(reports, split) for split in plan.splits},
        "tracker": tracker_runs(plan.inputs.tracker, run_ids),
    }
    summary["previous"] = _previous(plan, summary)
    (partial.root / REPORT_JSON).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (partial.root / REPORT_MARKDOWN).write_text(report_markdown(summary), encoding="utf-8")
    return summary


def _previous(plan: EvaluatePlan, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The comparison with the previous report (`evaluate.compare_with`, else the newest in the history)."""
    found = previous_report(plan.output, plan.config.compare_with)
    if found is None:
        return None
    path, previous = found
    return {
        "path": str(path),
        "created_at": previous.get("created_at", path.stem),
        "comparison": compare_reports(summary, previous),
    }


def tracker_runs(tracker: AnyTrackerConfig, run_ids: dict[str, str]) -> dict[str, Any]:
    """The evaluation runs in the training run's family: candidate name -> its run's name, id and location."""
    runs = {
        name: {"name": f"evaluate {name}", "run_id": run_id, "location": tracker_location(tracker, run_id)}
        for name, run_id in run_ids.items()
    }
    # JSONL and TensorBoard runs are files/folders of one directory; aim and wandb runs join an experiment/group.
    family = str(tracker.directory) if isinstance(tracker, JsonlTrackerConfig | TensorBoardTrackerConfig) else ""
    return {
        "kind": tracker.kind,
        "family": family or tracker_location(tracker, ""),
        "runs": runs if tracker.kind != "none" else {},
    }


def _draw_curves(plan: EvaluatePlan, reports: dict[str, dict[str, Any]], root: Path, notes: list[str]) -> list[str]:
    """The training loss of pretrain (and fine-tune) per step, with the held-out losses on that stage's data."""
    wanted = [(LOSS_CURVE, plan.inputs.pretrain_output, PRETRAIN_SPLIT, "pretrain loss")]
    if FINETUNE_SPLIT in plan.splits and plan.inputs.finetune_output is not None:
        wanted.append((FINETUNE_LOSS_CURVE, plan.inputs.finetune_output, FINETUNE_SPLIT, "fine-tune loss"))
    drawn: list[str] = []
    for name, stage_output, split, title in wanted:
        held_out = {checkpoint: splits[split]["loss"] for checkpoint, splits in reports.items()}
        try:
            plot_loss_curve(read_losses(stage_output / LOSSES_FILE), held_out, root / name, title=f"{title}, {split}")
        except PlotUnavailable as error:
            notes.append(f"no loss curve: {error}")
            return drawn
        drawn.append(name)
    return drawn


def comparison(reports: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Fine-tuned vs pretrained held-out loss on the fine-tune data (None without a fine-tuned checkpoint)."""
    if "finetune" not in reports or FINETUNE_SPLIT not in reports["finetune"]:
        return None
    pretrained = float(reports["pretrain"][FINETUNE_SPLIT]["loss"])
    finetuned = float(reports["finetune"][FINETUNE_SPLIT]["loss"])
    return {"split": FINETUNE_SPLIT, "pretrain": pretrained, "finetune": finetuned, "lower": finetuned < pretrained}


def _tokens(reports: dict[str, dict[str, Any]], split: str) -> int:
    return max((int(splits[split]["tokens"]) for splits in reports.values()), default=0)


def _artifacts(output: Path, statistics: Mapping[str, Any]) -> dict[str, str]:
    artifacts = {"report": str(output / REPORT_MARKDOWN), "report json": str(output / REPORT_JSON)}
    for name in statistics.get("loss_curves", []):
        artifacts["loss curve" if name == LOSS_CURVE else "fine-tune curve"] = str(output / name)
    tracker = statistics.get("tracker")
    if isinstance(tracker, dict) and tracker.get("runs"):
        runs = len(tracker["runs"])
        artifacts["tracker run"] = f"{tracker['kind']}, {runs} runs (checkpoint x split): {tracker['family']}"
    return artifacts


REPORTER = StageReporter(STAGE_NAME, RECORDED_PACKAGES, _artifacts)


def commit(
    directory: StageDirectory, partial: PartialStage, plan: EvaluatePlan, statistics: dict[str, Any]
) -> StageResult:
    files = [SUITE_FILE, LOG_FILE, REPORT_JSON, REPORT_MARKDOWN, *statistics.get("loss_curves", [])]
    for candidate in plan.candidates:
        files += [f"{candidate.name}/{REPORT_JSON}", f"{candidate.name}/{REPORT_MARKDOWN}"]
        if candidate.downstream and (partial.root / candidate.name / DOWNSTREAM_JSON).is_file():
            files.append(f"{candidate.name}/{DOWNSTREAM_JSON}")
    # The tasks' documents (what was scored); their YAMLs name this partial directory's path and are pruned.
    files += sorted(f"{TASKS_DIR}/{path.name}" for path in (partial.root / TASKS_DIR).glob("*.jsonl"))
    return REPORTER.commit(directory, partial, plan.key, plan.output, outputs=files, statistics=statistics)


def skipped(plan: EvaluatePlan, completeness: Completeness) -> StageResult:
    return REPORTER.skipped(plan.output, completeness)


def preflight(config: JobConfig) -> None:
    section = config.evaluate
    seq_len = section.seq_len or config.pretrain.seq_len
    # One micro-batch per step: a pipelined evaluation runs the schedule's forward-only program over it.
    degrees = check_topology("evaluate", section, config.pretrain.model, seq_len=seq_len, microbatches_per_step=1)
    check_evaluation_offload("evaluate", section.data_parallel)
    if section.rows_per_step % degrees.dp:
        raise PreflightError(
            f"evaluate.rows_per_step={section.rows_per_step} is not a multiple of the data-parallel size {degrees.dp} "
            f"(evaluate.nproc_per_node={section.nproc_per_node}, {degrees.describe()}); every data-parallel rank "
            "evaluates the same number of rows per step"
        )
    # Tensor parallelism scores and generates (without sequence parallelism, which the program turns off for it);
    # context parallelism splits every sequence over ranks and pipeline stages hold no whole model.
    why = {
        "cp": "it splits every sequence over ranks, and a decode step has one token per row",
        "pp": "each pipeline stage holds part of the layers; the adapter and generation run a whole model per rank",
    }
    refused = {name: value for name in why if (value := getattr(degrees, name)) > 1}
    if degrees.ep > 1 and degrees.tp > 1:
        why["ep"] = "with tp, expert dispatch of whole (not sequence-parallel) activations has no parity test yet"
        refused["ep"] = degrees.ep
    if refused and (section.tasks or section.prompts):
        shown = ", ".join(f"evaluate.degrees.{name}={value} ({why[name]})" for name, value in refused.items())
        raise PreflightError(
            f"evaluate.tasks and evaluate.prompts (task scores and sample continuations) are not supported with "
            f"{shown}: set evaluate.tasks=[] and evaluate.prompts=[] to evaluate held-out loss alone with these "
            "degrees, or evaluate with data and tensor parallelism (degrees.tp) only"
        )
    if section.tasks and find_spec("lm_eval") is None:
        raise PreflightError(
            f"evaluate.tasks={section.tasks} are scored with lm-evaluation-harness, which is not installed; "
            "install it with `pip install 'd9d-models[eval]'`, or set evaluate.tasks=[]"
        )
    if section.compare_with is not None:
        try:
            read_report(section.compare_with)
        except ValueError as error:
            raise PreflightError(str(error)) from error


def reads(config: JobConfig) -> dict[str, Path]:
    needs = {"data-prep": config.data_prep_output, "pretrain": config.pretrain_output}
    if config.evaluate.finetune:
        needs |= {"finetune-data": config.finetune_data_output, "finetune": config.finetune_output}
    return needs


def _run(plan: EvaluatePlan, directory: StageDirectory, progress: Progress) -> StageResult:
    partial = directory.open_partial(plan.key)
    result = commit(directory, partial, plan, run_evaluate_stage(plan, partial, progress))
    record(plan.output, result.statistics)  # after the commit: the history only names reports that exist
    return result


def artifacts(result: StageResult) -> list[Artifact]:
    """The report as Prefect artifacts, so the flow run's page shows it."""
    markdown = Path(result.output, REPORT_MARKDOWN).read_text(encoding="utf-8")
    return [
        MarkdownArtifact(key="evaluation-report", markdown=markdown, description=f"evaluation of {result.output}"),
        TableArtifact(
            key="evaluation-table",
            rows=table_rows(result.statistics),
            description=f"held-out loss per checkpoint and split, {result.output}",
        ),
        TableArtifact(
            key="evaluation-scores",
            rows=score_rows(result.statistics),
            description=f"every score per checkpoint (held-out data and tasks), {result.output}",
        ),
    ]


SPEC: StageSpec[EvaluatePlan] = StageSpec(
    name=STAGE_NAME,
    section="evaluate",
    summary=(
        "held-out loss, perplexity and bits per byte, lm-eval task scores and sample continuations of each "
        "checkpoint into <workdir>/evaluation"
    ),
    reads=reads,
    output=lambda config: config.evaluate_output,
    preflight=preflight,
    plan=lambda config, progress: plan_evaluate(config.evaluate, config.evaluate_inputs(), config.evaluate_output),
    describe=lambda plan: f"running {len(plan.checkpoints)} checkpoint(s) on {len(plan.splits)} split(s)",
    run=_run,
    skipped=skipped,
    artifacts=artifacts,
)
