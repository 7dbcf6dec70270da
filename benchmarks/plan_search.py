"""Planner benchmarks. Prints one JSON object per line: {"name","config","metric","value","unit","baseline","ratio"}.

- plan_search: configurations enumerated and priced per second by `orangetron plan` (cold caches).
- plan_published: predicted MFU vs the published MFU of large runs (ratio = predicted / published).
- plan_ibgda: throughput of a stream of small messages, GPU-initiated (IBGDA) vs CPU proxy (ratio).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from orangetron.plan.hardware import make_cluster
from orangetron.plan.models import load_model
from orangetron.plan.network import message_throughput
from orangetron.plan.search import search

CASES = [("llama3-8b", "h100", 64, 8192, 256), ("llama3-70b", "h100", 256, 8192, 512),
         ("mixtral-8x7b", "h100", 64, 4096, 256), ("deepseek-v3", "h100", 1024, 4096, 4096)]


def emit(name: str, config: str, metric: str, value: float, unit: str, baseline: float | None = None) -> None:
    ratio = value / baseline if baseline else None
    print(json.dumps({"name": name, "config": config, "metric": metric, "value": value, "unit": unit,
                      "baseline": baseline, "ratio": ratio}), flush=True)


def bench_search() -> None:
    for model, gpu, gpus, seq, batch in CASES:
        spec, cluster = load_model(model), make_cluster(gpu, gpus)
        start = time.perf_counter()
        result = search(spec, cluster, seq, batch)
        elapsed = time.perf_counter() - start
        config = f"{model} {gpus}x{gpu} seq={seq} batch={batch}"
        emit("plan_search", config, "configs_per_s", result.considered / elapsed, "configs/s")
        emit("plan_search", config, "search_time", elapsed, "s")
        best = result.ranked[0] if result.ranked else None
        if best:
            emit("plan_search", config, "best_mfu", best.time.mfu, "fraction")


def bench_published() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_plan_timing as published

    for name, shape, tp, pp, dp, batch, rc, pub in published.KORTHIKANTI:
        emit("plan_published", f"korthikanti-{name}", "mfu",
             published.korthikanti_mfu(shape, tp, pp, dp, batch, rc), "fraction", pub)
    for name, cp, dp, seq, batch, pub in published.LLAMA3:
        emit("plan_published", f"llama3-{name}", "mfu_causal", published.llama3_mfu(cp, dp, seq, batch),
             "fraction", pub)


def bench_ibgda() -> None:
    cluster = make_cluster("h100", 16)
    for size in (8, 64, 256, 1024, 4096, 65536, 1 << 20):
        gpu = message_throughput(size, cluster, "ibgda")
        proxy = message_throughput(size, cluster, "proxy")
        emit("plan_ibgda", f"{size}B messages, 400 Gb/s NIC", "throughput", gpu / 1e9, "GB/s", proxy / 1e9)


if __name__ == "__main__":
    bench_search()
    bench_published()
    bench_ibgda()
