"""Profiling on a schedule: `torch.profiler` traces of chosen steps, one Chrome trace per rank and cycle."""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.profiler import ProfilerActivity, profile, schedule


class ProfilingConfig(BaseModel):
    """Skip `wait` steps, warm up for `warmup`, record `active`; `repeat` cycles (0: for the whole run)."""

    model_config = ConfigDict(extra="forbid")

    directory: Path
    wait: int = Field(default=5, ge=0)
    warmup: int = Field(default=1, ge=0)
    active: int = Field(default=2, ge=1)
    repeat: int = Field(default=1, ge=0)
    record_shapes: bool = False
    with_stack: bool = False


class StepProfiler:
    """Wraps `torch.profiler.profile`; `step()` after every training step; traces to
    `<directory>/rank-XXXXX/step-XXXXXXXX.json`."""

    def __init__(self, config: ProfilingConfig, *, rank: int, device: torch.device) -> None:
        self._directory = config.directory / f"rank-{rank:05d}"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._step = 0
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=config.repeat),
            on_trace_ready=self._write,
            record_shapes=config.record_shapes,
            with_stack=config.with_stack,
        )

    def _write(self, finished: profile) -> None:
        self._directory.mkdir(parents=True, exist_ok=True)
        finished.export_chrome_trace(str(self._directory / f"step-{self._step:08d}.json"))

    def start(self) -> None:
        self._profile.start()

    def step(self, step: int) -> None:
        self._step = step
        self._profile.step()

    def stop(self) -> None:
        self._profile.stop()
