"""ZeRO-1, ZeRO-2 and Megatron's distributed optimizer: every rank keeps the whole parameters, as under DDP,
but updates only its slice of them; gradients are reduce-scattered so each rank gets the averaged slice it
updates.

ZeRO-1 and the distributed optimizer keep a full main-gradient buffer, ZeRO-2 only its slice. After the step
every rank's slice is all-gathered back into the whole parameters: right away under the distributed optimizer
(eager), before the next forward under ZeRO-1/2 (lazy; an evaluation or a checkpoint in between sees them too,
as `before_forward` and `state_loaded` gather). With `grad_bucket_numel` the equal buckets of the flat buffers
are reduce-scattered during backward (`ShardedGradBuckets`) and gathered bucket by bucket.
"""

from __future__ import annotations

from orangetron.parallel.data.buckets import ShardedGradBuckets
from orangetron.parallel.data.buffers import DataParallelBuffers
from orangetron.parallel.data.replicated import ReplicatedStrategy


class ShardedStrategy(ReplicatedStrategy):
    """ZeRO-1/2 (lazy parameter all-gather) or the distributed optimizer (eager): whole parameters between the
    gathers, sharded main parameters and optimizer state (ZeRO-2: and main gradients), gradients reduce-scattered.

    The reduction, `no_sync` and `zero_grad` are DDP's (`ReplicatedStrategy`) with reduce-scatters for
    all-reduces: `FlatPart.reduce` and the buckets read the shard count off the parts.
    """

    def __init__(self, buffers: DataParallelBuffers) -> None:
        super().__init__(buffers)
        self.eager = buffers.config.distributed_optimizer
        self.params_stale = False  # the parameters lag the main parameters until the lazy all-gather

    def _make_buckets(self) -> ShardedGradBuckets:
        return ShardedGradBuckets(self.buffers)

    def before_forward(self) -> None:
        if self.params_stale:
            self.gather_params()

    def after_step(self) -> None:
        super().after_step()
        if self.eager:
            self.gather_params()
        else:
            self.params_stale = True

    def state_loaded(self) -> None:
        super().state_loaded()
        if any(part.shards > 1 for part in self.buffers.parts):
            self.gather_params()
        self.params_stale = False

    def gather_params(self) -> None:
        for part in self.buffers.parts:
            part.gather()
        self.params_stale = False
