"""Data parallelism over the dp x cp ranks (experts over edp) as strategies behind one interface:
`DataParallelStrategy` (`strategy.py`), implemented by `ReplicatedStrategy` (DDP), `ShardedStrategy` (ZeRO-1/2
and the distributed optimizer) and `Zero3Strategy` (ZeRO-3 by unit), chosen once by `strategy_for(config)`.

They share one `DataParallelBuffers` (the flat parts, groups and transient bytes); `ShardedAdamW` updates the
slices a rank owns. `orangetron.parallel.ParallelModel` puts them together with the model.
"""

from orangetron.parallel.data.buffers import DataParallelBuffers
from orangetron.parallel.data.choose import strategy_for
from orangetron.parallel.data.replicated import ReplicatedStrategy
from orangetron.parallel.data.sharded import ShardedStrategy
from orangetron.parallel.data.sharded_adamw import ShardedAdamW
from orangetron.parallel.data.strategy import DataParallelStrategy
from orangetron.parallel.data.zero3 import Zero3Strategy

__all__ = ["DataParallelBuffers", "DataParallelStrategy", "ReplicatedStrategy", "ShardedAdamW", "ShardedStrategy",
           "Zero3Strategy", "strategy_for"]
