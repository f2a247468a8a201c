"""Configuration of tensor parallelism (pydantic, unknown keys rejected). The degree itself is `MeshDegrees.tp`."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TensorParallelConfig(BaseModel):
    """Options of tensor parallelism. `sequence_parallel=True` (training's layout) splits the activations between
    the tensor-parallel regions along the sequence; `False` keeps them whole on every rank (each region ends in an
    all-reduce), which a one-token decode step needs (generation, docs/design/0019). Both lay the parameters out the
    same way, so the same checkpoint loads under either."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sequence_parallel: bool = Field(
        default=True,
        description="split activations between regions along the sequence (training); False: replicated "
        "activations for inference (any sequence length, e.g. one-token decode steps)",
    )

    async_tp: bool = Field(
        default=False,
        description="micro-pipelined all-gather/reduce-scatter matmuls (CUDA only, takes effect under torch.compile)",
    )

    @model_validator(mode="after")
    def _async_tp_needs_sequence_parallel(self) -> Self:
        if self.async_tp and not self.sequence_parallel:
            raise ValueError(
                "async_tp=True needs sequence_parallel=True: it fuses the all-gather/matmul and matmul/reduce-scatter "
                "pairs of sequence parallelism, which sequence_parallel=False replaces by all-reduces"
            )
        return self
