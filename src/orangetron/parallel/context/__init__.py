"""Context parallelism: sequence sharding over the cp ranks (head-tail, or balanced over packed documents) and
attention across them."""

from orangetron.parallel.context.attention import attention
from orangetron.parallel.context.core import ContextParallelAttention
from orangetron.parallel.context.sharding import (
    head_tail_indices,
    pad_sequence,
    position_ids,
    shard,
    shard_indices,
    shard_multiple,
    unshard,
)

__all__ = ["ContextParallelAttention", "attention", "head_tail_indices", "pad_sequence", "position_ids", "shard",
           "shard_indices", "shard_multiple", "unshard"]
