"""`RankTopology`: how many ranks a launched stage runs on and how they are arranged. The one definition of it:
every launched stage's section (pretrain, finetune, evaluate) inherits it, and the rank configs embed those
sections unchanged, so a rank program reads its topology from the same fields a user sets with `--set`.

Tensor, context, expert and pipeline parallelism are degrees of `MeshDegrees` (`degrees.tp`, ...); a pipeline
schedule or another rank-layout choice belongs here too, so that every launched stage gets it at once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.core.dist import MeshDegrees
from d9d.parallel import AnyDataParallelConfig, FsdpConfig
from d9d.parallel.tensor import TensorParallelConfig

Device = Literal["auto", "cpu", "cuda"]


class RankTopology(BaseModel):
    """Ranks per node under `torchrun`, the mesh degrees over them, the data- and tensor-parallel options, and the
    device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nproc_per_node: int = Field(default=2, ge=1, description="local ranks under torchrun (gloo on CPU, NCCL on GPUs)")
    degrees: MeshDegrees = Field(default_factory=lambda: MeshDegrees(dp_shard=-1))
    data_parallel: AnyDataParallelConfig = Field(default_factory=FsdpConfig)
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="options of tensor parallelism (with degrees.tp > 1)"
    )
    device: Device = "auto"

    def data_parallel_size(self) -> int | None:
        """The data-parallel size on `nproc_per_node` ranks when only data parallelism is used (None: not known
        before launch, e.g. with tensor parallelism the mesh decides)."""
        if self.degrees == MeshDegrees(dp_shard=-1):
            return self.nproc_per_node
        return None
