"""Expert parallelism: DeepEP-style dispatch and combine, and the expert-parallel MoE layer."""

from orangetron.parallel.expert.apply import expert_parallel
from orangetron.parallel.expert.bias import update_router_bias
from orangetron.parallel.expert.dispatcher import Dispatcher, run_local_experts
from orangetron.parallel.expert.layer import expert_parallel_moe

__all__ = ["Dispatcher", "expert_parallel", "expert_parallel_moe", "run_local_experts", "update_router_bias"]
