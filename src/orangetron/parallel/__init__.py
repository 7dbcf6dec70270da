"""Parallel dimensions applied to a reference model from outside: one module per dimension."""

from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.contract import ModelContract, ModelContractError
from orangetron.parallel.data import ShardedAdamW
from orangetron.parallel.parallel_model import DataParallel, ParallelModel
from orangetron.parallel.parallelize import parallelize
from orangetron.parallel.replace import replace_module
from orangetron.parallel.tensor import tensor_parallel

__all__ = ["DataParallel", "ModelContract", "ModelContractError", "ParallelConfig", "ParallelConfigError",
           "ParallelModel", "ShardedAdamW", "parallelize", "replace_module", "tensor_parallel"]
