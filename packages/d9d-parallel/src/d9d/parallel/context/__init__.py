"""Context parallelism: sequences split over the `cp` ranks in a load-balanced causal layout.

Batches are sharded where they are prepared (`ContextParallelDataSource`, `shard_batch_for_context`); attention
over the sharded sequence is a ring (`ring_attention`) or an all-gather of keys/values (`all_gather_attention`).
Design: docs/design/0006-context-parallelism.md.
"""

from d9d.parallel.context.all_gather import all_gather_attention, gather_sequence
from d9d.parallel.context.batch import (
    ContextParallelDataSource,
    check_context_parallel,
    positions_within_documents,
    shard_batch_for_context,
)
from d9d.parallel.context.blocks import BlockMask, eager_block_backward, eager_block_forward
from d9d.parallel.context.comm import all_gather_sequence, reduce_scatter_sequence
from d9d.parallel.context.config import ContextAttention, ContextParallelConfig, build_context_attention
from d9d.parallel.context.layout import chunk_indices, global_positions, shard_sequence, unshard_sequence
from d9d.parallel.context.ring import ring_attention

__all__ = [
    "BlockMask",
    "ContextAttention",
    "ContextParallelConfig",
    "ContextParallelDataSource",
    "all_gather_attention",
    "all_gather_sequence",
    "build_context_attention",
    "check_context_parallel",
    "chunk_indices",
    "eager_block_backward",
    "eager_block_forward",
    "gather_sequence",
    "global_positions",
    "positions_within_documents",
    "reduce_scatter_sequence",
    "ring_attention",
    "shard_batch_for_context",
    "shard_sequence",
    "unshard_sequence",
]
