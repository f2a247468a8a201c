"""The `evaluate` section of a job, and the evaluate rank program's configs: one model (`EvaluateConfig`, for a
standalone run) or a suite of them (`EvaluateSuiteConfig`, the stage's, embedding the section unchanged), and what
the ranks score beyond held-out loss (`DownstreamConfig`: lm-eval tasks and sample continuations)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from d9d.flows.jobs.launchers import AnyLauncherConfig, LocalLauncherConfig
from d9d.flows.jobs.launchers.config import launcher_nodes
from d9d.flows.jobs.topology import RankTopology
from d9d.metrics.trackers import AnyTrackerConfig, NoTrackerConfig
from d9d.models.catalogue import AnyModelConfig

# The project's local lm-eval tasks (d9d.flows.jobs.evaluation_tasks), built from the job's held-out works.
DEFAULT_TASKS = ("d9d_next_line_shakespeare", "d9d_cloze_shakespeare", "d9d_next_line_milton", "d9d_cloze_milton")
# Openings of a play and of an epic: one in each corpus's style, and one neutral.
DEFAULT_PROMPTS = (
    "Now is the winter of our discontent",
    "Of Man's first disobedience, and the fruit",
    "The king",
)


class EvaluateStageConfig(RankTopology):
    """The `evaluate` section of a job: which checkpoints, how much of each validation split, on how many ranks,
    which lm-eval tasks and sample prompts per checkpoint, and which earlier report to compare with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int | None = Field(default=None, gt=0, description="None: the pretrain stage's seq_len")
    rows_per_step: int = Field(default=8, gt=0, description="rows per step over all ranks")
    steps: int | None = Field(default=None, ge=1, description="None: one pass over each validation split")
    base: bool = Field(default=True, description="also evaluate the convert stage's output (when it fits)")
    finetune: bool = Field(
        default=True, description="also evaluate the fine-tune stage's merged weights, and every checkpoint on the "
        "fine-tune data's validation split"
    )  # fmt: skip
    grace_seconds: float = Field(default=10.0, gt=0, description="after SIGTERM on cancel, before SIGKILL")
    output: Path | None = Field(default=None, description="default: <workdir>/evaluation")
    retries: int = Field(default=0, ge=0)
    retry_delay_seconds: float = Field(default=10.0, ge=0)
    tasks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TASKS),
        description="lm-eval tasks scored per checkpoint through lm_eval's evaluator: the local d9d_next_line_* / "
        "d9d_cloze_* tasks (built from the job's held-out works) or hub task names; [] for none",
    )
    limit: int | None = Field(default=40, ge=1, description="documents per task (None: every document)")
    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PROMPTS), description="continued greedily by every checkpoint"
    )
    max_new_tokens: int = Field(default=24, gt=0, description="tokens generated per prompt")
    task_batch_size: int = Field(default=16, gt=0, description="lm-eval requests per forward")
    compare_with: Path | None = Field(
        default=None,
        description="an earlier evaluation.json to show deltas against; None: the newest report in the history "
        "beside the output (<output>-history/)",
    )

    @field_validator("tasks")
    @classmethod
    def _tasks_named(cls, tasks: list[str]) -> list[str]:
        for task in tasks:
            if not task or not task.strip() or task != task.strip():
                raise ValueError(f"evaluate.tasks holds {task!r}; each task is an lm-eval task name")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"evaluate.tasks={tasks} names a task twice")
        return tasks

    @field_validator("prompts")
    @classmethod
    def _prompts_not_empty(cls, prompts: list[str]) -> list[str]:
        if any(not prompt for prompt in prompts):
            raise ValueError(f"evaluate.prompts={prompts} holds an empty prompt; give each some text")
        return prompts

    launcher: AnyLauncherConfig = Field(
        default_factory=LocalLauncherConfig, description="where the ranks run: local (torchrun here), slurm, kubernetes"
    )

    def node_count(self) -> int:
        return launcher_nodes(self.launcher)

    def key_config(self, seq_len: int) -> dict[str, Any]:
        return {
            "seq_len": seq_len,
            "rows_per_step": self.rows_per_step,
            "steps": self.steps,
            "base": self.base,
            "finetune": self.finetune,
            "tasks": self.tasks,
            "limit": self.limit,
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
            "compare_with": str(self.compare_with) if self.compare_with is not None else None,
        }


class DownstreamConfig(BaseModel):
    """What the ranks score per model beyond held-out loss: `tasks` through lm_eval's own evaluator with d9d's
    adapter (local tasks from `tasks_dir`), and greedy continuations of `prompts`; text through `tokenizer` (the
    data-prep stage's `tokenizer.json`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokenizer: Path
    tasks: list[str] = Field(default_factory=list)
    tasks_dir: Path | None = Field(default=None, description="lm-eval task YAMLs (the local tasks); None: hub only")
    limit: int | None = Field(default=None, ge=1)
    batch_size: int = Field(default=16, gt=0)
    max_length: int = Field(gt=1, description="tokens one scoring forward sees (longer contexts lose the oldest)")
    prompts: list[str] = Field(default_factory=list)
    max_new_tokens: int = Field(default=24, gt=0)


class EvaluateConfig(RankTopology):
    """One model over one held-out set (the standalone form of the rank program)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: AnyModelConfig
    shards: Path = Field(description="held-out token-shard set (the data-prep stage's validation split)")
    seq_len: int = Field(gt=0)
    rows_per_step: int = Field(default=8, gt=0, description="rows per step over all data-parallel ranks")
    steps: int | None = Field(default=None, ge=1, description="None: one pass over the set")
    checkpoint: Path | None = Field(
        default=None, description="a job checkpoint folder, or a directory of them (newest complete); None: init"
    )
    weights: Path | None = Field(
        default=None, description="d9d-layout safetensors weights (a converted checkpoint); exclusive of checkpoint"
    )
    output: Path
    seed: int = 0
    tracker: AnyTrackerConfig = Field(
        default_factory=NoTrackerConfig, description="log the results into this run family (e.g. pretrain's tracker)"
    )
    run_name: str = Field(
        default="evaluate", description="the tracker run's name (aim, wandb; JSONL and TensorBoard keep it in hparams)"
    )
    downstream: DownstreamConfig | None = Field(default=None, description="tasks and sample continuations; None: none")


class EvaluateCandidate(BaseModel):
    """One model of a suite: its architecture and where its weights come from (neither: the seeded init)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the report goes into output/<name>/")
    model: AnyModelConfig
    checkpoint: Path | None = None
    weights: Path | None = None
    shards: Path | None = Field(default=None, description="its held-out set; None: the suite's")
    downstream: bool = Field(default=False, description="also score the suite's tasks and prompts with this model")


class EvaluateSuiteConfig(BaseModel):
    """What every evaluate rank reads in the stage (`suite.yaml`): the job's `evaluate` section as the user set it,
    and the models over held-out sets (the suite's, or a candidate's own) resolved by the stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: EvaluateStageConfig
    candidates: list[EvaluateCandidate] = Field(min_length=1)
    shards: Path
    seq_len: int = Field(gt=0)
    output: Path
    seed: int = 0
    tracker: AnyTrackerConfig = Field(default_factory=NoTrackerConfig)
    downstream: DownstreamConfig | None = None

    def single(self, candidate: EvaluateCandidate) -> EvaluateConfig:
        stage = self.stage
        return EvaluateConfig(
            **stage.topology(),
            rows_per_step=stage.rows_per_step,
            steps=stage.steps,
            seq_len=self.seq_len,
            seed=self.seed,
            tracker=self.tracker,
            shards=candidate.shards if candidate.shards is not None else self.shards,
            model=candidate.model,
            checkpoint=candidate.checkpoint,
            weights=candidate.weights,
            output=self.output / candidate.name,
            run_name=f"evaluate {candidate.name}",
            downstream=self.downstream if candidate.downstream else None,
        )
