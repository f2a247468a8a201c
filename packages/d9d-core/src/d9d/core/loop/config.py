"""`TrainerConfig`: the behaviour of the training loop (what the model, data and optimizer are is wired elsewhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.core.loop.profiling import ProfilingConfig


class CheckpointingConfig(BaseModel):
    """Job checkpoints under `directory`: one `step-XXXXXXXX` folder each, complete once its marker exists."""

    model_config = ConfigDict(extra="forbid")

    directory: Path
    every_steps: int | None = Field(default=None, ge=1, description="None: only at the end and on preemption")
    keep_last: int = Field(default=2, ge=1)
    resume: bool = Field(default=True, description="continue from the newest complete checkpoint if there is one")
    trainable_only: bool = Field(
        default=False,
        description="save only parameters that train (and their optimizer state), e.g. fine-tuning adapters; the "
        "frozen rest must be loaded from its own checkpoint before resuming",
    )


class NonFiniteConfig(BaseModel):
    """What the loop does when a step's loss or gradient norm is inf or nan (decided before the optimizer step,
    the same on every rank): `skip` drops the step (parameters, optimizer state and LR schedule unchanged), up to
    `max_consecutive_skips` steps in a row, and stops at the next non-finite one; `stop` stops at the first one."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["skip", "stop"] = "skip"
    max_consecutive_skips: int = Field(
        default=3, ge=1, description="with policy='skip': at most this many steps in a row are skipped, then it stops"
    )


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total_steps: int = Field(ge=1)
    global_batch_rows: int = Field(ge=1, description="rows (sequences) per optimizer step over all DP ranks")
    microbatch_rows: int = Field(ge=1, description="rows per forward/backward on one rank")
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    seed: int = 0
    log_every: int = Field(default=1, ge=1)
    validation_every: int | None = Field(default=None, ge=1)
    validation_steps: int = Field(default=1, ge=1, description="steps of the validation source per validation")
    gc_every: int | None = Field(default=50, ge=1, description="None: leave Python's automatic GC on")
    collective_timeout_s: float = Field(default=600.0, gt=0, description="used when building the process group")
    peak_flops_per_device: float | None = Field(default=None, gt=0, description="for MFU; None: MFU not logged")
    checkpointing: CheckpointingConfig | None = None
    non_finite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)
    profiling: ProfilingConfig | None = None

    @model_validator(mode="after")
    def _microbatch_divides(self) -> TrainerConfig:
        if self.global_batch_rows % self.microbatch_rows:
            raise ValueError(
                f"global_batch_rows={self.global_batch_rows} is not a multiple of "
                f"microbatch_rows={self.microbatch_rows}"
            )
        return self

    def microbatches_per_step(self, dp_size: int) -> int:
        """Micro-batches each data-parallel rank runs per step (the accumulation adapts to `dp_size`).

        Raises:
            ValueError: the global batch cannot be split evenly over `dp_size` ranks.
        """
        per_rank, remainder = divmod(self.global_batch_rows, dp_size * self.microbatch_rows)
        if remainder or per_rank == 0:
            raise ValueError(
                f"global_batch_rows={self.global_batch_rows} cannot be split into micro-batches of "
                f"{self.microbatch_rows} rows over {dp_size} data-parallel ranks; make it a multiple of "
                f"{dp_size * self.microbatch_rows}"
            )
        return per_rank
