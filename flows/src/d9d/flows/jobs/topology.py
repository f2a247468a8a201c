"""`RankTopology`: how many ranks a launched stage runs on and how they are arranged. The one definition of it:
every launched stage's section (pretrain, finetune, evaluate) inherits it, and the rank configs embed those
sections unchanged, so a rank program reads its topology from the same fields a user sets with `--set`.

Tensor, context, expert and pipeline parallelism are degrees of `MeshDegrees` (`degrees.tp`, `degrees.cp`,
`degrees.ep`, `degrees.pp`); their options (`tensor_parallel`, `context_parallel`, `pipeline`: the schedule and its
virtual stages) sit beside them, so every launched stage gets them at once. The rank programs hand all of it to
d9d-models' `build_model` (`d9d.flows.jobs.rank_wiring.build_rank_model`); preflight checks it against the model
and the batch before any rank starts (`d9d.flows.jobs.degree_checks`, docs/design/0015).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from d9d.core.dist import MeshDegrees
from d9d.parallel import AnyDataParallelConfig, FsdpConfig
from d9d.parallel.context import ContextParallelConfig
from d9d.parallel.tensor import TensorParallelConfig
from d9d.pipeline import PipelineConfig

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
    context_parallel: ContextParallelConfig = Field(
        default_factory=ContextParallelConfig, description="options of context parallelism (with degrees.cp > 1)"
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="the pipeline schedule and its virtual stages (with degrees.pp > 1); micro-batches per step are "
        "global_batch_rows / (data-parallel size x microbatch_rows)",
    )
    device: Device = "auto"

    @field_validator("degrees", mode="before")
    @classmethod
    def _data_parallel_fills(cls, value: object) -> object:
        """In a stage section `dp_shard` fills what the other degrees leave unless set (`--set pretrain.degrees.tp=2`
        on 4 ranks is tp=2 x dp_shard=2), as it does when `degrees` is not set at all."""
        if isinstance(value, dict) and "dp_shard" not in value:
            return {**value, "dp_shard": -1}
        return value

    @field_validator("data_parallel", mode="before")
    @classmethod
    def _default_data_parallel_kind(cls, value: object) -> object:
        """`data_parallel` without `kind` is the default kind, fsdp (`--set pretrain.data_parallel.offload=true` alone
        shards with offload, where the union would otherwise ask which kind was meant)."""
        if isinstance(value, dict) and "kind" not in value:
            return {**value, "kind": "fsdp"}
        return value

    def node_count(self) -> int:
        """Nodes the ranks run on: 1 here; a section with a cluster launcher says how many it asks for."""
        return 1

    def world_size(self) -> int:
        return self.nproc_per_node * self.node_count()

    def resolved_degrees(self) -> MeshDegrees:
        """`degrees` on `nproc_per_node x nodes` ranks (`dp_shard=-1` filled in); ValueError naming them when they
        do not fit."""
        return self.degrees.resolve(self.world_size())

    def data_parallel_size(self) -> int | None:
        """Ranks holding different rows: `dp_replicate x dp_shard` of the resolved degrees (None: the degrees do not
        fit the ranks; preflight reports that)."""
        try:
            return self.resolved_degrees().dp
        except ValueError:
            return None

    def topology(self) -> dict[str, Any]:
        """These fields alone, to build another `RankTopology` subclass from (e.g. a suite's per-model config)."""
        return {name: getattr(self, name) for name in RankTopology.model_fields}
