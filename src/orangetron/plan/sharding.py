"""How a flat buffer splits over n ranks: the one formula the runtime's ZeRO buffers and the planner share."""

from __future__ import annotations


def shard_numel(numel: int, shards: int) -> int:
    """Elements each rank owns: the buffer is padded so that every rank owns the same count."""
    return -(-numel // shards)


def padded_numel(numel: int, shards: int) -> int:
    """Length of the flat buffer once padded to a multiple of `shards`."""
    return shard_numel(numel, shards) * shards
