"""Context parallelism: sequence sharding over the cp ranks (attention modes arrive in their own files)."""

from orangetron.parallel.context.sharding import head_tail_indices, position_ids, shard, unshard

__all__ = ["head_tail_indices", "position_ids", "shard", "unshard"]
