"""Context parallelism: head-tail sequence sharding over the cp ranks and attention across them."""

from orangetron.parallel.context.attention import attention
from orangetron.parallel.context.core import ContextParallelAttention
from orangetron.parallel.context.sharding import (
    head_tail_indices,
    pad_sequence,
    position_ids,
    shard,
    shard_multiple,
    unshard,
)

__all__ = ["ContextParallelAttention", "attention", "head_tail_indices", "pad_sequence", "position_ids", "shard",
           "shard_multiple", "unshard"]
