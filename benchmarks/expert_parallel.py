"""Expert-parallel MoE layer throughput on 2 local gloo ranks: ragged vs capacity vs all-gather dispatch.

Each rank routes its tokens through one MoE layer (router, dispatch, its experts, combine) forward and
backward. The value is tokens per second over both ranks (median of the timed repeats); the ratio compares
each dispatcher with ragged, measured in the same run. Prints one JSON line per dispatcher.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from orangetron.layout import Layout
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig
from orangetron.model.moe import MoE
from orangetron.parallel.expert import Dispatcher, ExpertParallelMoE
from orangetron.testing import run_distributed, shutdown_workers

CFG = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_dim=512, n_experts=8, top_k=2,
                  moe_ffn_dim=256, aux_loss_coef=0.0)
TOKENS, REPEATS, EP = 2048, 8, 2
MODES = {"ragged": {}, "capacity": {"capacity_factor": 1.25}, "allgather": {}}


def layer_tokens_per_s(mode: str) -> float:
    mesh = init_mesh(Layout(dp=EP, ep=EP))
    torch.manual_seed(0)
    layer = ExpertParallelMoE(MoE(CFG), Dispatcher(mesh, CFG.n_experts, mode, **MODES[mode]), [mesh["dp_cp"]], EP)
    x = torch.randn(1, TOKENS, CFG.dim, generator=torch.Generator().manual_seed(mesh.rank), requires_grad=True)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        layer(x).square().mean().backward()
        times.append(time.perf_counter() - start)
    return EP * TOKENS / statistics.median(times[2:])  # the first passes warm the allocator


def main() -> None:
    results = {mode: run_distributed(layer_tokens_per_s, EP, args=(mode,))[0] for mode in MODES}
    for mode, value in results.items():
        config = {"dispatcher": mode, "ep": EP, "tokens_per_rank": TOKENS, "dim": CFG.dim,
                  "experts": CFG.n_experts, "top_k": CFG.top_k, **MODES[mode]}
        print(json.dumps({"name": "expert_parallel_dispatch", "config": config, "metric": "tokens_per_s",
                          "value": round(value, 1), "unit": "tokens/s", "baseline": round(results["ragged"], 1),
                          "ratio": round(value / results["ragged"], 3)}))
    shutdown_workers()


if __name__ == "__main__":
    main()
