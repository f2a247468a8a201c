"""A deterministic synthetic token stream: every global batch is a function of (seed, step) only.

Useful for tests and benchmarks: any data-parallel size sees the same global batch, and the position is one
integer, so resume is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class TokenBatch:
    input_ids: torch.Tensor  # (rows, seq)
    labels: torch.Tensor  # (rows, seq), IGNORE_INDEX where no loss


def synthetic_global_batch(
    *, seed: int, step: int, rows: int, seq_len: int, vocab_size: int, ignore_fraction: float = 0.0
) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    if ignore_fraction > 0:
        labels[torch.rand(labels.shape, generator=generator) < ignore_fraction] = IGNORE_INDEX
    return TokenBatch(input_ids=tokens[:, :-1].contiguous(), labels=labels)


class SyntheticTokenSource:
    """This data-parallel rank's micro-batches of each global batch (rows split contiguously by rank)."""

    def __init__(
        self,
        *,
        seed: int,
        global_rows: int,
        microbatch_rows: int,
        seq_len: int,
        vocab_size: int,
        dp_rank: int,
        dp_size: int,
        ignore_fraction: float = 0.0,
    ) -> None:
        if global_rows % (dp_size * microbatch_rows):
            raise ValueError(f"global_rows={global_rows} must be a multiple of dp_size*microbatch_rows")
        self._seed, self._global_rows, self._microbatch_rows = seed, global_rows, microbatch_rows
        self._seq_len, self._vocab_size, self._ignore = seq_len, vocab_size, ignore_fraction
        self._dp_rank, self._dp_size = dp_rank, dp_size
        self.steps_consumed = 0

    def next_step(self) -> list[TokenBatch]:
        batch = synthetic_global_batch(
            seed=self._seed,
            step=self.steps_consumed,
            rows=self._global_rows,
            seq_len=self._seq_len,
            vocab_size=self._vocab_size,
            ignore_fraction=self._ignore,
        )
        self.steps_consumed += 1
        per_rank = self._global_rows // self._dp_size
        start = self._dp_rank * per_rank
        return [
            TokenBatch(
                input_ids=batch.input_ids[row : row + self._microbatch_rows],
                labels=batch.labels[row : row + self._microbatch_rows],
            )
            for row in range(start, start + per_rank, self._microbatch_rows)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_consumed": self.steps_consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_consumed = int(state["steps_consumed"])
