"""Planner benchmarks. Prints one JSON object per line: {"name","config","metric","value","unit","baseline","ratio"}.

- plan_search: configurations per second of `orangetron plan`'s search (cold caches) vs pricing the same
  space one `estimate()` call at a time (ratio = search / one-by-one; search_time against the one-by-one
  time extrapolated from a sample).
- plan_search_documents: the search over packed documents (`plan --doc-lengths`: 20,000 lengths of 1 to
  3,000 tokens, seeded) vs the same search priced one document per sequence (ratio = packed / whole).
- plan_published: predicted vs published figure of the calibration rows of src/orangetron/plan/validation_runs.toml
  (ratio = predicted / published).
- plan_validation: the same for its validation rows (never fitted on).
- plan_reserved: the whole-GPU total (overhead included, metric "reserved") and the need the fit check compares
  with the GPU (metric "needed", at most 1) vs each published peak of reserved memory of its `[[reserved]]` rows
  (ratio = predicted / published), calibration and validation rows named as such.
- plan_ibgda: throughput of a stream of small messages, GPU-initiated (IBGDA) vs CPU proxy (ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from orangetron.plan.estimate import estimate
from orangetron.plan.network import message_throughput
from orangetron.plan.search import SearchSpace, candidate_degrees, candidate_jobs, search
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import load_model
from orangetron.spec.options import Job

CASES = [("llama3-8b", "h100", 64, 8192, 256), ("llama3-70b", "h100", 256, 8192, 512),
         ("mixtral-8x7b", "h100", 64, 4096, 256), ("deepseek-v3", "h100", 1024, 4096, 4096)]


def emit(name: str, config: str, metric: str, value: float, unit: str, baseline: float | None = None) -> None:
    ratio = value / baseline if baseline else None
    print(json.dumps({"name": name, "config": config, "metric": metric, "value": value, "unit": unit,
                      "baseline": baseline, "ratio": ratio}), flush=True)


def naive_configs_per_s(spec, cluster, seq: int, batch: int, sample: int = 300) -> float:
    """The same space priced one `estimate()` call per configuration, with no grouping or pruning."""
    space, priced, start = SearchSpace(), 0, time.process_time()
    for deg in candidate_degrees(spec, cluster, space, seq):
        for group in candidate_jobs(spec, deg, seq, batch, space, Job(seq_len=seq)):
            for job in group:
                with contextlib.suppress(ValueError):  # invalid layouts cost a validation, as in search
                    estimate(spec, deg, job, cluster)
                priced += 1
                if priced == sample:
                    return priced / (time.process_time() - start)
    return priced / (time.process_time() - start)


def bench_search() -> None:
    for model, gpu, gpus, seq, batch in CASES:
        spec, cluster = load_model(model), make_cluster(gpu, gpus)
        start = time.process_time()
        result = search(spec, cluster, seq, batch)
        elapsed = time.process_time() - start
        naive = naive_configs_per_s(spec, cluster, seq, batch)
        config = f"{model} {gpus}x{gpu} seq={seq} batch={batch} configs={result.considered}"
        emit("plan_search", config, "configs_per_s", result.considered / elapsed, "configs/s", naive)
        emit("plan_search", config, "search_time", elapsed, "s", result.considered / naive)


def bench_search_documents() -> None:
    import random

    rng = random.Random(0)
    lengths = tuple(rng.randint(1, 3000) for _ in range(20_000))
    spec, cluster, seq, batch = load_model("llama3-8b"), make_cluster("h100", 16), 32768, 16
    seconds = []
    for base in (Job(seq_len=seq), Job(seq_len=seq, doc_lengths=lengths)):
        start = time.process_time()
        result = search(spec, cluster, seq, batch, base=base)
        seconds.append(time.process_time() - start)
    config = f"llama3-8b 16xh100 seq={seq} batch={batch} configs={result.considered} documents={len(lengths)}"
    emit("plan_search_documents", config, "search_time", seconds[1], "s", seconds[0])


def bench_published() -> None:
    """Every row of src/orangetron/plan/validation_runs.toml: calibration rows as plan_published, validation rows
    as plan_validation."""
    from orangetron.plan import validation

    units = {"mfu": "fraction", "mfu_causal": "fraction", "tflops": "TFLOP/s per GPU (with recompute)",
             "model_tflops": "model TFLOP/s per GPU (full attention)", "tokens": "tokens/s per GPU"}
    for run in validation.load_runs():
        kind = "plan_published" if run.split == "calibration" else "plan_validation"
        emit(kind, f"{run.name} [{run.cls}]", run.metric, validation.predict(run), units[run.metric], run.published)


def bench_reserved() -> None:
    from orangetron.plan import reserved

    gib = 1024**3
    for row in reserved.load_reserved():
        if row.metric == "reserved_gib":
            emit("plan_reserved", f"{row.name} [{row.split}]", "reserved", reserved.predicted_bytes(row) / gib, "GiB",
                 row.published)
            # What the fit check compares with the GPU: never above the published peak (the pressured share's bound).
            emit("plan_reserved", f"{row.name} [{row.split}]", "needed", reserved.needed_bytes(row) / gib, "GiB",
                 row.published)


def bench_ibgda() -> None:
    cluster = make_cluster("h100", 16)
    for size in (8, 64, 256, 1024, 4096, 65536, 1 << 20):
        gpu = message_throughput(size, cluster, "ibgda")
        proxy = message_throughput(size, cluster, "proxy")
        emit("plan_ibgda", f"{size}B messages, 400 Gb/s NIC", "throughput", gpu / 1e9, "GB/s", proxy / 1e9)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    bench_search()
    bench_search_documents()
    bench_published()
    bench_reserved()
    bench_ibgda()
