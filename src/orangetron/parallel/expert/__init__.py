"""Expert parallelism: DeepEP-style dispatch and combine, and the expert-parallel MoE layer."""

from orangetron.parallel.expert.dispatcher import Dispatcher, run_local_experts

__all__ = ["Dispatcher", "run_local_experts"]
