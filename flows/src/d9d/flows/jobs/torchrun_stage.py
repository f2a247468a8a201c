"""What the launched stages share: their section's base (`LaunchedStageConfig`, `TrainingStageConfig`), and the
launch of a training rank program with its progress turned into a losses file."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from d9d.core.loop import CheckpointingConfig, TrainerConfig
from d9d.core.lr import AnyLRScheduleConfig, ConstantScheduleConfig, build_lr_schedule
from d9d.core.optim import AdamWConfig, AnyOptimizerConfig
from d9d.flows.jobs.degree_checks import check_topology
from d9d.flows.jobs.launch import LaunchSpec
from d9d.flows.jobs.launchers import AnyLauncherConfig, LocalLauncherConfig, build_launcher
from d9d.flows.jobs.launchers.config import launcher_nodes
from d9d.flows.jobs.offload_checks import check_training_offload
from d9d.flows.jobs.progress import Progress
from d9d.flows.jobs.rank_failure import rank_errors
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.flows.jobs.topology import RankTopology
from d9d.metrics.trackers import AnyTrackerConfig
from d9d.models.catalogue import AnyModelConfig

JOB_FILE = "job.yaml"
LOSSES_FILE = "losses.jsonl"
LOG_FILE = "launch.log"
KEY_FIELDS_SINCE_0009 = frozenset({"base", "base_mapping", "export_hf_peft"})
# Model-section fields added since, with their defaults: left out of a key at the default, like the ones above.
MODEL_KEY_FIELDS_SINCE_0009: dict[tuple[str, str], object] = {
    ("decoder", "compile_model"): False,
    ("decoder", "loss_gradients_in_forward"): False,
}


def model_key_config(model: dict[str, Any]) -> dict[str, Any]:
    """A model section's JSON dump as a stage key holds it: `MODEL_KEY_FIELDS_SINCE_0009` left out at their defaults."""
    for (section, name), default in MODEL_KEY_FIELDS_SINCE_0009.items():
        fields = model.get(section)
        if isinstance(fields, dict) and name in fields and fields[name] == default:
            del fields[name]
    return model


_TAIL_BYTES = 4096  # longer than any loss record


class LaunchedStageConfig(RankTopology):
    """A stage that runs a rank program under `torchrun`: its topology (`RankTopology`) and how patiently, where to
    and with which tracker. None of these changes what is computed, so none is in the stage's key (a checkpoint
    resumes on another data-parallel size with the same global batch)."""

    # Below the 30 s a Prefect runner waits before it SIGKILLs a cancelled flow-run process (and with it the launcher).
    grace_seconds: float = Field(default=25.0, gt=0, description="after SIGTERM on cancel, before SIGKILL")
    tracker: AnyTrackerConfig | None = Field(
        default=None, description="experiment tracker; None: a JSONL tracker in the stage output's tracker/"
    )
    output: Path | None = Field(default=None, description="default: <workdir>/<stage>")
    retries: int = Field(default=0, ge=0)
    retry_delay_seconds: float = Field(default=10.0, ge=0)
    launcher: AnyLauncherConfig = Field(
        default_factory=LocalLauncherConfig, description="where the ranks run: local (torchrun here), slurm, kubernetes"
    )

    def node_count(self) -> int:
        return launcher_nodes(self.launcher)

    def key_config(self) -> dict[str, Any]:
        """The fields that change what is computed: every field but the ones above. Fields added since a stage's
        first release (`KEY_FIELDS_SINCE_0009`, `MODEL_KEY_FIELDS_SINCE_0009`) count only when set, so outputs
        committed before them stay valid."""
        key = self.model_dump(mode="json", exclude=set(LaunchedStageConfig.model_fields))
        defaults = type(self).model_fields
        for name in KEY_FIELDS_SINCE_0009 & key.keys():
            if getattr(self, name) == defaults[name].get_default(call_default_factory=True):
                del key[name]
        if isinstance(key.get("model"), dict):
            key["model"] = model_key_config(key["model"])
        return key


class TrainingStageConfig(LaunchedStageConfig):
    """The loop of a training stage (in its key): steps, batch, checkpoints, clipping, seeds, optimizer and schedule.
    A stage redeclares a field to change its default (fine-tuning trains fewer steps at a higher learning rate)."""

    steps: int = Field(default=100, ge=1)
    global_batch_rows: int = Field(default=16, ge=1, description="rows per optimizer step over all ranks")
    microbatch_rows: int = Field(default=4, ge=1, description="rows per forward/backward on one rank")
    checkpoint_every: int | None = Field(default=50, ge=1, description="None: at the end and on SIGTERM only")
    keep_last: int = Field(default=2, ge=1)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    seed: int = 0
    shuffle_seed: int = 0
    optimizer: AnyOptimizerConfig = Field(default_factory=AdamWConfig)
    lr_schedule: AnyLRScheduleConfig = Field(default_factory=ConstantScheduleConfig)

    def trainer_config(self, checkpoints: Path, *, trainable_only: bool = False) -> TrainerConfig:
        """The rank program's loop, checkpointing into `checkpoints`."""
        return TrainerConfig(
            total_steps=self.steps,
            global_batch_rows=self.global_batch_rows,
            microbatch_rows=self.microbatch_rows,
            max_grad_norm=self.max_grad_norm,
            seed=self.seed,
            checkpointing=CheckpointingConfig(
                directory=checkpoints,
                every_steps=self.checkpoint_every,
                keep_last=self.keep_last,
                trainable_only=trainable_only,
            ),
        )

    def check_batch(self, section: str) -> None:
        """The global batch splits into micro-batches over the data-parallel ranks (when that size is known)."""
        dp = self.data_parallel_size()
        if dp is not None and self.global_batch_rows % (dp * self.microbatch_rows):
            raise PreflightError(
                f"{section}.global_batch_rows={self.global_batch_rows} cannot be split into micro-batches of "
                f"{section}.microbatch_rows={self.microbatch_rows} over {dp} data-parallel ranks "
                f"({section}.nproc_per_node={self.nproc_per_node}, {self.resolved_degrees().describe()}); make it a "
                f"multiple of {dp * self.microbatch_rows}"
            )

    def check_topology(self, section: str, model: AnyModelConfig, *, seq_len: int) -> None:
        """The degrees fit the ranks, `model`, `seq_len` and the micro-batches per step (`degree_checks`), and CPU
        offload, if asked for, fits the degrees and the optimizer (`offload_checks`)."""
        dp = self.data_parallel_size()
        per_rank = self.global_batch_rows // (dp * self.microbatch_rows) if dp is not None else None
        degrees = check_topology(section, self, model, seq_len=seq_len, microbatches_per_step=per_rank or None)
        check_training_offload(section, self.data_parallel, degrees, self.optimizer)

    def check_schedule(self, section: str) -> None:
        """The LR schedule resolves for `steps` steps (what the rank program does first; e.g. a warm-up longer
        than the run fails here, before any process starts)."""
        try:
            build_lr_schedule(self.lr_schedule, self.steps)
        except ValueError as error:
            raise PreflightError(
                f"{section}.lr_schedule does not fit {section}.steps={self.steps}: {error}; raise {section}.steps "
                f"or shorten the schedule's phases (--set {section}.lr_schedule.kind=constant drops it)"
            ) from error


@dataclass(frozen=True, kw_only=True)
class TrainingRun:
    losses: dict[int, float]  # step -> training loss, over every attempt
    resumed_from: str | None
    started: datetime

    def seconds(self) -> float:
        return round((datetime.now(UTC) - self.started).total_seconds(), 1)


def launch_training(
    module: str, job: BaseModel, settings: LaunchedStageConfig, root: Path, progress: Progress, *, name: str
) -> TrainingRun:
    """Write `job` to `root/job.yaml` and run `module` on it on `nproc_per_node` ranks (per node, with the launcher
    the section names), logging into `root`."""
    job_file = root / JOB_FILE
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    spec = LaunchSpec(
        module=module,
        args=["--config", str(job_file)],
        nproc_per_node=settings.nproc_per_node,
        log_file=root / LOG_FILE,
        grace_seconds=settings.grace_seconds,
    )
    tracker = StepTracker(root / LOSSES_FILE, progress, name=name)
    started = datetime.now(UTC)
    failed = True
    try:
        with rank_errors(spec.log_file, lambda cause: f"{name}: a rank failed:\n{cause}"):
            launcher = build_launcher(settings.launcher, settings, name=name)
            launcher.run(spec, on_progress=tracker, note=progress.note)
        failed = False
    finally:
        progress.finish(failed=failed)
    losses = read_losses(root / LOSSES_FILE)
    require_finite_last_loss(losses, name=name)
    return TrainingRun(losses=losses, resumed_from=tracker.resumed_from, started=started)


class NonFiniteLossError(RuntimeError):
    """A training stage's last loss is inf or nan: its model is not committed as the stage's output."""


def require_finite_last_loss(losses: dict[int, float], *, name: str) -> None:
    """Refuse to let a stage commit a model whose last recorded loss is not finite (its checkpoints stay)."""
    if losses and not math.isfinite(last := losses[max(losses)]):
        raise NonFiniteLossError(
            f"{name}: the loss of the last step ({max(losses)}) is {last}; the model is not committed as the "
            "stage's output (its partial directory and checkpoints are kept). Lower the learning rate or check "
            "the data, then rerun"
        )


class StepTracker:
    """Turns a training rank program's progress lines into progress updates and a losses file (step -> loss)."""

    def __init__(self, path: Path, progress: Progress, *, name: str) -> None:
        self._path = path
        self._name = name
        self._progress = progress
        self.resumed_from: str | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        match record.get("event"):
            case "started":
                self.resumed_from = record.get("resumed_from")
                self._progress.start(self._name, float(record["total"]), "steps")
                if record["step"]:
                    self._progress.advance(float(record["step"]), f"resumed from {self.resumed_from}")
            case "step":
                append_loss(self._path, int(record["step"]), float(record["loss"]))
                self._progress.advance(1.0, f"loss {record['loss']:.3f}")


def append_loss(path: Path, step: int, loss: float) -> None:
    """Append one record; a torn last line (the writer was killed mid-line) is cut off first, so that torn text
    never ends up in the middle of the file where `read_losses` would refuse it."""
    line = json.dumps({"step": step, "loss": loss}) + "\n"
    with path.open("a+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size:
            handle.seek(max(size - _TAIL_BYTES, 0))
            tail = handle.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                handle.truncate(size - len(tail) + cut + 1 if cut >= 0 else max(size - len(tail), 0))
        handle.write(line.encode("utf-8"))


def read_losses(path: Path) -> dict[int, float]:
    """Step -> training loss; a step recorded by several attempts keeps its last value.

    A torn last line (a writer killed mid-line) is skipped, as the tracker's reader does: that step is logged again
    by the resumed run. An unreadable line anywhere else is damage, not a kill, and is an error naming the line.
    """
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    losses: dict[int, float] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            losses[int(record["step"])] = float(record["loss"])
        except (ValueError, KeyError, TypeError) as error:
            if number == len(lines):
                break  # torn by a kill while it was written
            raise ValueError(f"{path}:{number} is not a loss record ({error!r}): {line[:80]!r}") from error
    return losses
