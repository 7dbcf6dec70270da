"""Parallel dimensions applied to a reference model from outside: one module per dimension."""

from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.data import ShardedAdamW
from orangetron.parallel.parallel_model import DataParallel, ParallelModel
from orangetron.parallel.parallelize import parallelize
from orangetron.parallel.tensor import TensorParallelTransformer, tensor_parallel

__all__ = ["DataParallel", "ParallelConfig", "ParallelConfigError", "ParallelModel", "ShardedAdamW",
           "TensorParallelTransformer", "parallelize", "tensor_parallel"]
