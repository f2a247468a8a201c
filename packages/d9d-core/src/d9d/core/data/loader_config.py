"""Configuration of data loading (pydantic, unknown keys rejected) and `build_data_loader`."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Annotated, Any, Literal, TypeVar, assert_never

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field
from torch.utils.data import Dataset, default_collate

from d9d.core.data.loader import DataParallelLoader
from d9d.core.data.ordering import LengthBucketedOrder, SampleOrder, SequentialOrder, ShuffledOrder
from d9d.core.data.sharding import UnevenPolicy

T = TypeVar("T")


class SequentialOrderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sequential"] = "sequential"


class ShuffledOrderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["shuffled"] = "shuffled"
    seed: int = 0


class LengthBucketedOrderConfig(BaseModel):
    """Shuffled, then global batches of similar length; needs per-sample lengths (see `bucketing`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["length_bucketed"] = "length_bucketed"
    seed: int = 0
    window_batches: int = Field(default=64, ge=1, description="global batches sorted together")


AnySampleOrderConfig = Annotated[
    SequentialOrderConfig | ShuffledOrderConfig | LengthBucketedOrderConfig, Field(discriminator="kind")
]


class DataLoaderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    global_batch_size: int = Field(ge=1, description="samples per step over all data-parallel ranks")
    order: AnySampleOrderConfig = Field(default_factory=ShuffledOrderConfig)
    uneven: UnevenPolicy = "drop"
    epochs: int | None = Field(default=None, ge=1, description="epochs per iteration; None: endless")
    num_workers: int = Field(default=0, ge=0)
    pin_memory: bool = Field(
        default=False,
        description=(
            "hand out batches in page-locked host memory (torch's DataLoader `pin_memory`), so that a "
            "`.to('cuda', non_blocking=True)` copy overlaps the GPU's work instead of CUDA first staging the batch "
            "through a pageable buffer; for CUDA runs only (pinning needs CUDA and holds host memory). Off by "
            "default: this config does not know the device (d9d-flows turns it on for CUDA ranks)"
        ),
    )


def build_sample_order(
    config: AnySampleOrderConfig,
    num_samples: int,
    *,
    global_batch_size: int,
    lengths: npt.NDArray[np.int64] | None = None,
) -> SampleOrder:
    match config:
        case SequentialOrderConfig():
            return SequentialOrder(num_samples)
        case ShuffledOrderConfig():
            return ShuffledOrder(num_samples, config.seed)
        case LengthBucketedOrderConfig():
            if lengths is None or len(lengths) != num_samples:
                found = "none" if lengths is None else f"{len(lengths)}"
                raise ValueError(
                    f"order kind='length_bucketed' needs one length per sample ({num_samples}), got {found}; pass "
                    "`lengths=` or use a dataset with a `lengths` attribute (e.g. TokenDocumentDataset)."
                )
            return LengthBucketedOrder(np.asarray(lengths, dtype=np.int64), global_batch_size, config.seed)
        case _:
            assert_never(config)


def build_data_loader(
    config: DataLoaderConfig,
    dataset: Dataset[T],
    *,
    dp_rank: int,
    dp_size: int,
    collate_fn: Callable[[list[T]], Any] = default_collate,
    lengths: npt.NDArray[np.int64] | None = None,
) -> DataParallelLoader[T]:
    """A loader for rank `dp_rank` of `dp_size`; `lengths` defaults to `dataset.lengths` when it has one."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"{type(dataset).__name__} has no __len__; build_data_loader takes map-style datasets")
    if lengths is None:
        lengths = getattr(dataset, "lengths", None)
    order = build_sample_order(config.order, len(dataset), global_batch_size=config.global_batch_size, lengths=lengths)
    return DataParallelLoader(
        dataset,
        order=order,
        global_batch_size=config.global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        collate_fn=collate_fn,
        uneven=config.uneven,
        epochs=config.epochs,
        num_workers=config.num_workers,
        pin_memory=config.pin_memory,
    )
