"""Tensor parallelism, with or without sequence parallelism: styles on a module and a 1-D `tp` mesh,
vocabulary-parallel embedding and loss, async TP. Model plans (which module gets which style, found by name or
role) live with the models."""

from d9d.parallel.tensor.async_tp import enable_async_tp
from d9d.parallel.tensor.config import TensorParallelConfig
from d9d.parallel.tensor.mesh import fold_tp_into_shard
from d9d.parallel.tensor.styles import (
    COLUMN_PLACEMENTS,
    REPLICATED,
    ROW_PLACEMENTS,
    SEQUENCE,
    parallelize_column,
    parallelize_local_region,
    parallelize_replicated,
    parallelize_row,
    parallelize_sequence,
    prepare_region_input,
)
from d9d.parallel.tensor.vocab import (
    parallelize_vocab_embedding,
    parallelize_vocab_head,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from d9d.parallel.tensor.vocab_summed import vocab_parallel_cross_entropy_sum

__all__ = [
    "COLUMN_PLACEMENTS",
    "REPLICATED",
    "ROW_PLACEMENTS",
    "SEQUENCE",
    "TensorParallelConfig",
    "enable_async_tp",
    "fold_tp_into_shard",
    "parallelize_column",
    "parallelize_local_region",
    "parallelize_replicated",
    "parallelize_row",
    "parallelize_sequence",
    "parallelize_vocab_embedding",
    "parallelize_vocab_head",
    "prepare_region_input",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_sum",
    "vocab_parallel_logits",
]
