"""Parallel degrees of a job and their validation against the world size."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEGREE_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


class MeshDegrees(BaseModel):
    """How many ranks each kind of parallelism spans.

    `pp * dp_replicate * dp_shard * cp * tp` must equal the world size. `ep` does not multiply into the world size:
    expert parallelism folds over the data and context parallel ranks, so `ep` must divide
    `dp_replicate * dp_shard * cp` (see `d9d.core.dist.domains`). `dp_shard=-1` takes whatever the other degrees
    leave of the world size.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pp: int = Field(default=1, ge=1, description="pipeline stages")
    dp_replicate: int = Field(default=1, ge=1, description="data-parallel replicas (gradients all-reduced)")
    dp_shard: int = Field(default=1, ge=-1, description="data-parallel shards (FSDP); -1 fills the world size")
    cp: int = Field(default=1, ge=1, description="context-parallel ranks splitting the sequence")
    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks splitting each layer")
    ep: int = Field(default=1, ge=1, description="expert-parallel ranks, folded over dp_replicate * dp_shard * cp")

    def describe(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in DEGREE_NAMES)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_fold(self) -> int:
        """Ranks that expert parallelism folds over: data-parallel times context-parallel ranks."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def resolve(self, world_size: int) -> MeshDegrees:
        """Return these degrees with `dp_shard=-1` filled in and everything checked against `world_size`.

        Raises:
            ValueError: naming the degrees, the world size and what would be valid.
        """
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        degrees = self
        if self.dp_shard == 0:
            raise ValueError(f"dp_shard=0 is not a degree ({self.describe()}); use a positive value or -1 to fill")
        if self.dp_shard == -1:
            others = self.pp * self.dp_replicate * self.cp * self.tp
            if world_size % others != 0:
                raise ValueError(
                    f"dp_shard=-1 cannot fill the world size {world_size}: the other degrees multiply to {others} "
                    f"({self.describe()}), which does not divide {world_size}; choose degrees whose product divides "
                    f"{world_size}."
                )
            degrees = self.model_copy(update={"dp_shard": world_size // others})
        if degrees.world_size != world_size:
            raise ValueError(
                f"mesh degrees multiply to {degrees.world_size} but the world size is {world_size} "
                f"({degrees.describe()}); make the product pp*dp_replicate*dp_shard*cp*tp equal {world_size}, "
                f"or set dp_shard=-1 to fill it."
            )
        if degrees.expert_fold % degrees.ep != 0:
            valid = divisors(degrees.expert_fold)
            raise ValueError(
                f"ep={degrees.ep} must divide dp_replicate*dp_shard*cp = {degrees.expert_fold} "
                f"({degrees.describe()}); valid ep values: {', '.join(map(str, valid))}."
            )
        return degrees

    @property
    def is_resolved(self) -> bool:
        return self.dp_shard >= 1

    def expert_replicate(self) -> int:
        """Replicas of each expert shard: the data and context ranks left after expert parallelism."""
        return self.expert_fold // self.ep


def divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]
