"""How a flat buffer splits over n ranks: the one formula the runtime's ZeRO buffers and the planner share."""

from __future__ import annotations


def shard_numel(numel: int, shards: int) -> int:
    """Elements each rank owns: the buffer is padded so that every rank owns the same count."""
    return -(-numel // shards)


def padded_numel(numel: int, shards: int) -> int:
    """Length of the flat buffer once padded to a multiple of `shards`."""
    return shard_numel(numel, shards) * shards


def bucket_layout(numel: int, bucket_numel: int, shards: int) -> tuple[int, int]:
    """(count, elements each) of the equal gradient buckets a sharded flat buffer is cut into.

    Every bucket is a multiple of `shards` (each rank owns one equal slice of each) and at most `bucket_numel`
    rounded up to one. The padding (under `shards` elements per bucket) lies at the end of the last bucket, so
    the parameters stay one contiguous run. With `bucket_numel` 0 the whole buffer is one bucket.
    """
    if bucket_numel <= 0 or numel == 0:
        return 1, padded_numel(numel, shards)
    count = -(-numel // padded_numel(bucket_numel, shards))
    return count, padded_numel(-(-numel // count), shards)


def token_chunks(tokens: int, chunks: int) -> list[int]:
    """Tokens per overlap chunk: `chunks` contiguous ranges, the first `tokens % chunks` one token longer."""
    base, extra = divmod(tokens, chunks)
    return [base + (c < extra) for c in range(chunks)]
