"""Configuration of tensor parallelism (pydantic, unknown keys rejected). The degree itself is `MeshDegrees.tp`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TensorParallelConfig(BaseModel):
    """Options of tensor + sequence parallelism; sequence parallelism is always on with `tp > 1`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    async_tp: bool = Field(
        default=False,
        description="micro-pipelined all-gather/reduce-scatter matmuls (CUDA only, takes effect under torch.compile)",
    )
