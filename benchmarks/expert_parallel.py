"""Expert-parallel MoE layer on 2 local gloo ranks: overlapped vs serial dispatch-compute-combine, and ragged vs
capacity vs all-gather dispatch throughput, in one run.

Overlap: one MoE layer (router, ragged dispatch, its experts, combine) forward, and forward with backward, with
the tokens in 1 chunk (serial) and in 2 and 4 chunks (`overlap_chunks`), at two expert widths (64 and 32), sized so
that the all-to-alls take about half and about as long as the expert compute: the "comm_share" line is the
serial forward's time with the experts replaced by the identity, over the serial forward's time. Serial and
overlapped passes alternate within one launch, so both see the same machine load; values are medians and each
ratio is overlapped / serial time (below 1: the overlap hides communication).

Dispatchers: the layer forward and backward with each dispatcher; tokens per second over both ranks, each
ratio against ragged. Every line is one JSON object.

`--one-rank` prints only one line, in this process: `GroupedExperts` forward and backward in float32 through
`torch._grouped_mm` against the loop over experts; ratio loop time over grouped (above 1: grouped is faster).
On two loaded CPU cores this says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

import torch

from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, ModelSpec
from orangetron.model.moe import GroupedExperts, MoE
from orangetron.parallel.expert import Dispatcher, expert_parallel_moe
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers

EP, REPEATS, WARMUP = 2, 15, 2
DISPATCH_CFG = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_dim=512, n_experts=8,
                           top_k=2, moe_ffn_dim=256, aux_loss_coef=0.0)
DISPATCH_TOKENS = 2048
MODES = {"ragged": {}, "capacity": {"capacity_factor": 1.25}, "allgather": {}}
# Wide rows and narrow experts: the all-to-alls move 16 KiB per row while each copy costs little compute; two
# expert widths, so that the expert compute is about twice and about once the all-to-alls' share.
OVERLAP_CFGS = [ModelConfig(dim=4096, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_dim=512, n_experts=8,
                            top_k=2, moe_ffn_dim=width, aux_loss_coef=0.0) for width in (64, 32)]
OVERLAP_TOKENS = 1024
CHUNKS = (1, 2, 4)


def _layer(cfg: ModelSpec, mesh, mode: str, chunks: int = 1, **options) -> MoE:
    torch.manual_seed(0)
    dispatcher = Dispatcher(mesh, cfg.n_experts, mode, overlap_chunks=chunks, **options)
    return expert_parallel_moe(MoE(cfg), dispatcher, [mesh["dp_cp"]], EP)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def overlap_times(cfg: ModelSpec) -> dict[str, float]:
    """Median seconds per pass: forward and forward+backward for each chunk count, and the comm-only forward."""
    mesh = init_mesh(Layout(dp=EP, ep=EP))
    layers = {c: _layer(cfg, mesh, "ragged", c) for c in CHUNKS}
    serial = layers[1].dispatcher

    def comm_only() -> torch.Tensor:  # the serial layer's router and all-to-alls, the experts an identity
        idx, w = layers[1].router.route(x.view(-1, cfg.dim))[2:]
        return serial.dispatch_compute_combine(x.view(-1, cfg.dim), idx, w, None, lambda _, rows, *rest: rows)
    x = torch.randn(1, OVERLAP_TOKENS, cfg.dim, generator=torch.Generator().manual_seed(mesh.rank))
    xg = x.clone().requires_grad_()
    times: dict[str, list[float]] = {}
    for repeat in range(WARMUP + REPEATS):
        passes = {f"forward/{c}": (lambda c=c: layers[c](x)) for c in CHUNKS}
        passes |= {f"step/{c}": (lambda c=c: layers[c](xg).square().mean().backward()) for c in CHUNKS}
        passes["forward/comm_only"] = comm_only
        for name, fn in passes.items():
            with torch.no_grad() if name.startswith("forward") else torch.enable_grad():
                seconds = _timed(fn)
            if repeat >= WARMUP:
                times.setdefault(name, []).append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def layer_tokens_per_s(mode: str) -> float:
    mesh = init_mesh(Layout(dp=EP, ep=EP))
    layer = _layer(DISPATCH_CFG, mesh, mode, **MODES[mode])
    x = torch.randn(1, DISPATCH_TOKENS, DISPATCH_CFG.dim, generator=torch.Generator().manual_seed(mesh.rank),
                    requires_grad=True)
    times = [_timed(lambda: layer(x).square().mean().backward()) for _ in range(WARMUP + REPEATS)]
    return EP * DISPATCH_TOKENS / statistics.median(times[WARMUP:])


def _line(name: str, config: dict, metric: str, value: float, unit: str, baseline: float, ratio: float) -> str:
    return json.dumps({"name": name, "config": config, "metric": metric, "value": round(value, 6), "unit": unit,
                       "baseline": round(baseline, 6), "ratio": round(ratio, 3)})


def _overlap_lines(cfg: ModelSpec, times: dict[str, float]) -> None:
    config = {"dispatcher": "ragged", "ep": EP, "tokens_per_rank": OVERLAP_TOKENS, "dim": cfg.dim,
              "moe_ffn_dim": cfg.moe_ffn_dim, "experts": cfg.n_experts, "top_k": cfg.top_k}
    serial = times["forward/1"]
    print(_line("expert_parallel_overlap", config, "comm_share", times["forward/comm_only"], "s", serial,
                times["forward/comm_only"] / serial))
    for phase in ("forward", "step"):
        for chunks in CHUNKS[1:]:
            value, base = times[f"{phase}/{chunks}"], times[f"{phase}/1"]
            print(_line("expert_parallel_overlap", {**config, "overlap_chunks": chunks}, f"{phase}_time", value, "s",
                        base, value / base))


# ---- one rank: the experts through torch._grouped_mm against the loop ---------------------------------
GROUPED_EXPERTS, GROUPED_DIM, GROUPED_HIDDEN, GROUPED_ROWS = 8, 256, 512, 4096


def experts_step_s(grouped: bool) -> float:
    """Median seconds of GroupedExperts forward and backward over GROUPED_ROWS float32 copies, uneven counts."""
    torch.manual_seed(0)
    experts = GroupedExperts(GROUPED_EXPERTS, GROUPED_DIM, GROUPED_HIDDEN)
    counts = torch.distributions.Multinomial(GROUPED_ROWS, torch.ones(GROUPED_EXPERTS)).sample().long()
    x = torch.randn(GROUPED_ROWS, GROUPED_DIM, requires_grad=True)
    weights = torch.rand(GROUPED_ROWS)
    loop_only = mock.patch("orangetron.model.grouped_mm._runs_on", return_value=False)
    with contextlib.nullcontext() if grouped else loop_only:
        times = [_timed(lambda: experts(x, counts, weights).square().mean().backward())
                 for _ in range(WARMUP + REPEATS)]
    return statistics.median(times[WARMUP:])


def grouped_line() -> str:
    grouped, loop = experts_step_s(True), experts_step_s(False)
    config = {"experts": GROUPED_EXPERTS, "dim": GROUPED_DIM, "hidden": GROUPED_HIDDEN, "rows": GROUPED_ROWS,
              "dtype": "float32", "ranks": 1, "threads": torch.get_num_threads(), "baseline": "loop over experts"}
    return _line("grouped_experts_step", config, "step_time", grouped, "s", loop, loop / grouped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-rank", action="store_true", help="only the grouped-GEMM line, in this process")
    if parser.parse_args().one_rank:
        print(grouped_line())
        return
    print(grouped_line(), flush=True)
    for cfg in OVERLAP_CFGS:
        _overlap_lines(cfg, run_distributed(overlap_times, EP, args=(cfg,), timeout=1200)[0])
    results = {mode: run_distributed(layer_tokens_per_s, EP, args=(mode,), timeout=600)[0] for mode in MODES}
    for mode, value in results.items():
        config = {"dispatcher": mode, "ep": EP, "tokens_per_rank": DISPATCH_TOKENS, "dim": DISPATCH_CFG.dim,
                  "experts": DISPATCH_CFG.n_experts, "top_k": DISPATCH_CFG.top_k, **MODES[mode]}
        print(_line("expert_parallel_dispatch", config, "tokens_per_s", value, "tokens/s", results["ragged"],
                    value / results["ragged"]))
    shutdown_workers()


if __name__ == "__main__":
    main()
