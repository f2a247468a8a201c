"""Where the global stages live: `pp` ranks, `stages_per_rank` stages each, in loop or V placement."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Placement(enum.Enum):
    LOOP = "loop"  # rank r holds stages r, r+p, r+2p, ... (GPipe, 1F1B, interleaved)
    V = "v"  # rank r holds stages r and 2p-1-r (ZBV, DualPipeV): first and last stage on rank 0


@dataclass(frozen=True)
class StageLayout:
    pp: int
    stages_per_rank: int = 1
    placement: Placement = Placement.LOOP

    def __post_init__(self) -> None:
        if self.pp < 1 or self.stages_per_rank < 1:
            raise ValueError(f"pp={self.pp} and stages_per_rank={self.stages_per_rank} must both be at least 1")
        if self.placement is Placement.V and self.stages_per_rank != 2:
            raise ValueError(f"the V placement holds exactly 2 stages per rank, got {self.stages_per_rank}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside [0, {self.num_stages})")
        if self.placement is Placement.V:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages of `rank`, in order of depth (its first chunk first)."""
        if self.placement is Placement.V:
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(rank + chunk * self.pp for chunk in range(self.stages_per_rank))

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1
