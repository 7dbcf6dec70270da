"""Parallel dimensions applied to a reference model from outside: one module per dimension."""

from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.data import DataParallel, ShardedAdamW

__all__ = ["DataParallel", "ParallelConfig", "ParallelConfigError", "ShardedAdamW"]
