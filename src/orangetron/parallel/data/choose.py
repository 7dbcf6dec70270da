"""Which data-parallel strategy a `ParallelConfig` asks for: decided here, once, when the model is built."""

from __future__ import annotations

from orangetron.parallel.config import ParallelConfig
from orangetron.parallel.data.replicated import ReplicatedStrategy
from orangetron.parallel.data.sharded import ShardedStrategy
from orangetron.parallel.data.strategy import DataParallelStrategy
from orangetron.parallel.data.zero3 import Zero3Strategy


def strategy_for(config: ParallelConfig) -> type[DataParallelStrategy]:
    """ZeRO-3 by unit for `zero_stage=3`; sharded for ZeRO-1/2 and the distributed optimizer; else DDP."""
    if config.zero_stage == 3:
        return Zero3Strategy
    if config.shards_optimizer:
        return ShardedStrategy
    return ReplicatedStrategy
