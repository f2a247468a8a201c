"""Pipeline stages: which of a model's layers a stage builds (d9d-models builds stages from these).

A model for stage `index` of `count` builds only its own layers (in an `nn.ModuleDict` keyed by the global layer
index, so parameter names are the same as in the whole model), the embedding only on the first stage and the final
norm and head only on the last. Layers are spread evenly; the embedding and the head can count as extra "virtual"
layers so the first and last stages get fewer real ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    index: int = 0
    count: int = 1
    virtual_layers_pre: int = 0
    virtual_layers_post: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"stage index {self.index} is outside [0, {self.count}) stages")
        if self.virtual_layers_pre < 0 or self.virtual_layers_post < 0:
            raise ValueError("virtual layer counts must be non-negative")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, num_layers: int) -> range:
        """The global indices of the layers this stage builds out of `num_layers`.

        The `virtual_layers_pre + num_layers + virtual_layers_post` slots are split into `count` contiguous runs
        whose sizes differ by at most one (earlier stages take the remainder); the stage keeps the real layers of
        its run.
        """
        total = self.virtual_layers_pre + num_layers + self.virtual_layers_post
        if total < self.count:
            raise ValueError(f"{num_layers} layers (+{total - num_layers} virtual) cannot fill {self.count} stages")
        base, extra = divmod(total, self.count)
        start = self.index * base + min(self.index, extra)
        stop = start + base + (1 if self.index < extra else 0)
        first = max(start - self.virtual_layers_pre, 0)
        last = min(stop - self.virtual_layers_pre, num_layers)
        return range(first, max(first, last))


SINGLE_STAGE = PipelineStage()
