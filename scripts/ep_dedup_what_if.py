"""What if the expert all-to-all sent each token once per destination node? (docs/planner.md section 6)

The planner prices expert dispatch as one row per token and destination GPU, a fixed share of them over
InfiniBand. DeepEP, and DeepSeek-V3's own dispatch (arXiv:2412.19437 section 3.2.2), send a token once to each
node holding one of its experts and forward it there over NVLink. With top-k experts drawn at random from E
spread evenly over N nodes, a token reaches N * (1 - C(E - E/N, k) / C(E, k)) distinct nodes; DeepSeek-V3
limits that to M = 4 of its N = 8 (its own node among them with probability M/N).

This what-if is not part of the planner: it scales the inter-node part of every all-to-all by the ratio
of remote node copies to the planner's remote rows and reprices the MoE rows of the validation set and the
checks beside it. Prints one JSON object per run: the factor and the error before and after.
"""

from __future__ import annotations

import json
import sys
from math import comb
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_plan_validation as held_out  # noqa: E402

from orangetron.plan import network, timing  # noqa: E402
from orangetron.plan.hardware import make_cluster  # noqa: E402

NODE_LIMITED = {"DeepSeek-V3, 2048 GPUs": 4}  # at most 4 nodes per token (DeepSeek-V3 section 2.1.2)


def remote_copies(experts: int, top_k: int, nodes: int, limit: int = 0) -> float:
    """Expected nodes other than its own that one token is sent to."""
    per_node = experts // nodes
    if limit and limit < nodes:
        hit = 1 - comb(per_node * (limit - 1), top_k) / comb(per_node * limit, top_k)
        return limit * hit - limit / nodes * hit
    return (nodes - 1) * (1 - comb(experts - per_node, top_k) / comb(experts, top_k))


def dedup_factor(run: held_out.Run) -> float:
    """Remote node copies over the planner's remote rows per token (1 when the EP group is one node)."""
    deg, model = run.deg, run.model
    cluster = make_cluster(run.gpu, deg.world_size, run.gpus_per_node or None)
    where = timing._places(deg, cluster)["ep"]
    if deg.ep == 1 or where.nodes == 1:
        return 1.0
    rows = min(model.top_k, where.size) * (where.size - where.per_node) / (where.size - 1)
    return remote_copies(model.num_experts, model.top_k, where.nodes, NODE_LIMITED.get(run.name, 0)) / rows


def _scaled_rate(factor: float):
    """The NIC's message throughput divided by `factor`: `network.all_to_all_time` (its only caller) then takes
    `factor` times as long for the inter-node part and is unchanged within a node."""
    original = network.message_throughput

    def rate(msg_bytes, cluster, transport=None, params=network.DEFAULT_PARAMS):
        return original(msg_bytes, cluster, transport, params) / factor
    return rate


def _clear_timing_caches() -> None:
    for value in vars(timing).values():
        if hasattr(value, "cache_clear"):
            value.cache_clear()


def main() -> None:
    runs = [r for r in held_out.RUNS + held_out.BRIDGE_MOE + held_out.MODELZOO_MOE if r.model.is_moe]
    before = {r.name: held_out.predict(r) / r.published - 1 for r in runs}
    original = network.message_throughput
    for run in runs:
        factor = dedup_factor(run)
        if factor == 1.0:
            continue
        _clear_timing_caches()
        network.message_throughput = _scaled_rate(factor)
        try:
            after = held_out.predict(run) / run.published - 1
        finally:
            network.message_throughput = original
            _clear_timing_caches()
        print(json.dumps({"run": run.name, "remote_factor": round(factor, 3),
                          "error_before": round(before[run.name], 4), "error_after": round(after, 4)}))


if __name__ == "__main__":
    main()
