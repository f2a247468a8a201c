"""A `DataSource` over d9d's resumable data-parallel loaders (global position: epoch and samples consumed)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from d9d.core.pytree import split_microbatches


class PositionedLoader(Protocol):
    """`DataParallelLoader` / `DataParallelStreamLoader`: iterable of this rank's batches with a global position."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class LoaderDataSource:
    """Each step takes the loader's next batch (this rank's share of one global batch, e.g. `collate_packed`'s
    dict of `[rows, seq]` tensors) and splits it into `microbatches` equal micro-batches along rows.

    Raises (from `next_step`):
        StopIteration: the loader ran out (a finite number of epochs); give it `epochs=None` to train by steps.
    """

    def __init__(self, loader: PositionedLoader, microbatches: int) -> None:
        self._loader = loader
        self._microbatches = microbatches
        self._iterator: Iterator[Any] | None = None

    def next_step(self) -> list[Any]:
        if self._iterator is None:
            self._iterator = iter(self._loader)
        batch = next(self._iterator)
        return list(split_microbatches(batch, self._microbatches))

    def state_dict(self) -> dict[str, Any]:
        return dict(self._loader.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._loader.load_state_dict({key: int(value) for key, value in state.items()})
        self._iterator = None  # the next step re-opens the loader at the restored position
