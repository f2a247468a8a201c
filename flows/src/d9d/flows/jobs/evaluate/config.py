"""The `evaluate` section of a job, and the evaluate rank program's configs: one model (`EvaluateConfig`, for a
standalone run) or a suite of them (`EvaluateSuiteConfig`, the stage's, embedding the section unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from d9d.flows.jobs.launchers import AnyLauncherConfig, LocalLauncherConfig
from d9d.flows.jobs.launchers.config import launcher_nodes
from d9d.flows.jobs.topology import RankTopology
from d9d.metrics.trackers import AnyTrackerConfig, NoTrackerConfig
from d9d.models.catalogue import AnyModelConfig


class EvaluateStageConfig(RankTopology):
    """The `evaluate` section of a job: which checkpoints, how much of each validation split, on how many ranks."""

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
        }


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


class EvaluateCandidate(BaseModel):
    """One model of a suite: its architecture and where its weights come from (neither: the seeded init)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the report goes into output/<name>/")
    model: AnyModelConfig
    checkpoint: Path | None = None
    weights: Path | None = None
    shards: Path | None = Field(default=None, description="its held-out set; None: the suite's")


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
        )
