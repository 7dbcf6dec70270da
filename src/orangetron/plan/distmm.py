"""DistMM planner for dual encoders (Huang et al., "DistMM: Accelerating Distributed Multimodal Model
Training", NSDI 2024).

Each sample has one input per modality, so every tower processes the whole global batch. DistMM gives each
tower (submodule) its own devices and layout and runs the towers concurrently, joined by the contrastive
loss; the colocated baseline runs one layout for the whole model, the towers one after the other, on every
GPU. Three steps, as in the paper:
1. Modality-aware partitioning: per tower, every (tp, pp) with tp inside a node.
2. Data load balancing: split the GPUs between towers (and pick each tower's layout and micro-batch) so the
   slowest tower is as fast as possible; exhaustive over GPU splits in units of a node share.
3. Heterogeneity-aware placement: each tower gets a contiguous block of GPUs, largest first, so its tensor
   and data-parallel groups use NVLink where possible; we report the bytes that cross nodes compared with
   an interleaved placement that spreads every tower over every node.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from orangetron.plan.memory import memory_per_gpu
from orangetron.plan.timing import step_time
from orangetron.plan.traffic import data_parallel_records
from orangetron.spec.hardware import GIB, Cluster
from orangetron.spec.model import DualEncoderSpec, ModelSpec
from orangetron.spec.options import Degrees, Job, validate


@dataclass(frozen=True)
class TowerPlan:
    """One tower's share of the cluster and its layout."""

    name: str
    gpus: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    time_s: float
    memory_bytes: int
    first_gpu: int = 0
    cross_node_bytes: int = 0  # gradient bytes one rank sends over NICs per step


@dataclass(frozen=True)
class DistMMPlan:
    model: str
    gpus: int
    global_batch: int
    towers: tuple[TowerPlan, ...]
    step_s: float
    baseline_step_s: float
    baseline_layout: str
    interleaved_cross_node_bytes: int

    @property
    def gain(self) -> float | None:
        """The colocated step over this one; None where no colocated layout runs the batch (JSON has no inf)."""
        return None if math.isinf(self.baseline_step_s) else self.baseline_step_s / self.step_s

    def to_json(self) -> dict:
        baseline = None if self.gain is None else self.baseline_step_s
        return {
            "model": self.model, "gpus": self.gpus, "global_batch": self.global_batch,
            "towers": [t.__dict__ for t in self.towers], "step_time_s": self.step_s,
            "baseline_step_time_s": baseline, "baseline_layout": self.baseline_layout,
            "predicted_gain": self.gain,
            "recommend": "colocated" if self.gain is not None and self.gain < 1 else "distmm",
            "cross_node_bytes": sum(t.cross_node_bytes for t in self.towers),
            "interleaved_cross_node_bytes": self.interleaved_cross_node_bytes,
        }


def _tower_time(tower: ModelSpec, cluster: Cluster, gpus: int, tp: int, pp: int, batch: int,
                param_dtype: str, limit: float) -> tuple[float, int, int] | None:
    """(seconds, micro-batch, memory) of the fastest micro-batch that fits, or None."""
    dp = gpus // (tp * pp)
    if dp < 1 or gpus % (tp * pp) or dp > batch:  # a replica without a sample would only wait
        return None
    per_replica = -(-batch // dp)  # an uneven split runs at the pace of the largest replica batch
    sub = Cluster(cluster.gpu, gpus, min(cluster.gpus_per_node, gpus), cluster.nic_gbps, cluster.transport)
    best = None
    for mb in (1, 2, 4, 8, 16, 32):
        if mb > per_replica:
            break
        deg = Degrees(tp=tp, pp=pp, dp=dp)
        padded = -(-per_replica // mb) * mb * dp
        job = Job(seq_len=tower.seq_len, micro_batch=mb, global_batch=padded, sequence_parallel=tp > 1,
                  param_dtype=param_dtype, distributed_optimizer=dp > 1)
        try:
            validate(tower, deg, job)
        except ValueError:
            continue
        mem = memory_per_gpu(tower, deg, job)["total"]
        if mem > limit:
            continue
        t = step_time(tower, deg, job, sub).step_s
        if best is None or t < best[0]:
            best = (t, mb, mem)
    return best


def _layouts(tower: ModelSpec, cluster: Cluster, gpus: int) -> list[tuple[int, int]]:
    tps = [t for t in (1, 2, 4, 8) if t <= min(cluster.gpus_per_node, gpus) and tower.num_heads % t == 0]
    pps = [p for p in (1, 2, 4, 8) if p <= tower.num_layers]
    return [(t, p) for t, p in itertools.product(tps, pps) if gpus % (t * p) == 0]


def best_tower_plan(name: str, tower: ModelSpec, cluster: Cluster, gpus: int, batch: int, param_dtype: str,
                    limit: float) -> TowerPlan | None:
    """The fastest layout for `tower` on `gpus` GPUs processing `batch` samples."""
    best: TowerPlan | None = None
    for tp, pp in _layouts(tower, cluster, gpus):
        got = _tower_time(tower, cluster, gpus, tp, pp, batch, param_dtype, limit)
        if got and (best is None or got[0] < best.time_s):
            best = TowerPlan(name, gpus, tp, pp, gpus // (tp * pp), got[1], got[0], got[2])
    return best


def _splits(total: int, parts: int, unit: int):
    """Ways to write `total` as `parts` positive multiples of `unit`."""
    if parts == 1:
        yield (total,)
        return
    for first in range(unit, total - unit * (parts - 1) + 1, unit):
        for rest in _splits(total - first, parts - 1, unit):
            yield (first, *rest)


def _colocated(spec: DualEncoderSpec, cluster: Cluster, batch: int, dtype: str, limit: float) -> tuple[float, str]:
    """The best single layout for the whole model, towers run one after the other on every GPU."""
    best = (float("inf"), "none")
    towers = list(spec.towers.items())
    for tp, pp in _layouts(towers[0][1], cluster, cluster.num_gpus):
        times = [_tower_time(t, cluster, cluster.num_gpus, tp, pp, batch, dtype, limit / len(towers))
                 for _, t in towers]
        if all(times):
            total = sum(t[0] for t in times)
            if total < best[0]:
                best = (total, f"tp={tp} pp={pp} dp={cluster.num_gpus // (tp * pp)} for every tower")
    return best


def place(towers: list[TowerPlan], tower_specs: dict[str, ModelSpec], cluster: Cluster,
          param_dtype: str) -> tuple[list[TowerPlan], int]:
    """Contiguous blocks, largest tower first; (placed towers, cross-node bytes if interleaved instead)."""
    placed, start, interleaved = [], 0, 0
    g = cluster.gpus_per_node
    for tp in sorted(towers, key=lambda t: -t.gpus):
        spec = tower_specs[tp.name]
        deg = Degrees(tp=tp.tp, pp=tp.pp, dp=tp.dp)
        job = Job(seq_len=spec.seq_len, param_dtype=param_dtype)
        grads = sum(r.bytes_sent for r in data_parallel_records(spec, deg, job))
        span = len({(start + i) // g for i in range(tp.gpus)})
        crossing = grads if span > 1 and tp.dp > 1 else 0
        # Interleaved placement spreads every tower over every node: its gradients always cross nodes.
        interleaved += grads if cluster.nodes > 1 and tp.dp > 1 else 0
        placed.append(TowerPlan(tp.name, tp.gpus, tp.tp, tp.pp, tp.dp, tp.micro_batch, tp.time_s,
                                tp.memory_bytes, start, crossing))
        start += tp.gpus
    return placed, interleaved


def plan_distmm(spec: DualEncoderSpec, cluster: Cluster, global_batch: int, param_dtype: str = "bfloat16",
                memory_fraction: float = 0.9) -> DistMMPlan:
    """Per-tower devices, layout and micro-batch minimizing the slowest tower, placed to keep traffic local."""
    limit = cluster.gpu.memory_bytes * memory_fraction
    names = list(spec.towers)
    # Split in single GPUs on small clusters, in quarter-nodes on large ones (the search stays under a second).
    unit = 1 if cluster.num_gpus <= 32 else max(1, cluster.gpus_per_node // 4)
    best: tuple[float, list[TowerPlan]] | None = None
    for split in _splits(cluster.num_gpus, len(names), unit):
        plans = [best_tower_plan(n, spec.towers[n], cluster, gpus, global_batch, param_dtype, limit)
                 for n, gpus in zip(names, split, strict=True)]
        if not all(plans):
            continue
        slowest = max(p.time_s for p in plans)
        if best is None or slowest < best[0]:
            best = (slowest, plans)
    if best is None:
        raise ValueError(f"{spec.name}: no split of {cluster.num_gpus} x {cluster.gpu.name} fits global batch "
                         f"{global_batch}: each of its {len(names)} towers needs GPUs of its own, no more data-"
                         f"parallel replicas than sequences, and a layout whose memory fits in "
                         f"{memory_fraction:.0%} of a GPU; try more GPUs or another --global-batch")
    base_s, base_layout = _colocated(spec, cluster, global_batch, param_dtype, limit)
    placed, interleaved = place(best[1], spec.towers, cluster, param_dtype)
    # The contrastive loss gathers every embedding once per step on both sides; the same in both plans.
    return DistMMPlan(spec.name, cluster.num_gpus, global_batch, tuple(placed), best[0], base_s, base_layout,
                      interleaved)


def format_plan(plan: DistMMPlan) -> str:
    lines = [f"DistMM plan for {plan.model} on {plan.gpus} GPUs, global batch {plan.global_batch}:",
             f"{'tower':<8} {'gpus':>5} {'first':>6} {'tp':>3} {'pp':>3} {'dp':>4} {'mb':>3} {'mem GiB':>8} "
             f"{'time s':>8} {'cross-node GiB':>15}"]
    for t in plan.towers:
        lines.append(f"{t.name:<8} {t.gpus:>5} {t.first_gpu:>6} {t.tp:>3} {t.pp:>3} {t.dp:>4} {t.micro_batch:>3} "
                     f"{t.memory_bytes / GIB:>8.1f} {t.time_s:>8.3f} {t.cross_node_bytes / GIB:>15.2f}")
    if plan.gain is None:
        lines.append(f"step {plan.step_s:.3f} s (slowest tower); no colocated layout of {plan.gpus} GPUs runs "
                     f"{plan.global_batch} sequences (more data-parallel replicas than sequences)")
    else:
        lines.append(f"step {plan.step_s:.3f} s (slowest tower) vs colocated {plan.baseline_step_s:.3f} s "
                     f"({plan.baseline_layout}): predicted gain {plan.gain:.2f}x")
    if plan.gain is not None and plan.gain < 1:
        lines.append("the colocated layout is predicted faster for this model and cluster: keep it")
    lines.append(f"cross-node gradient traffic: {sum(t.cross_node_bytes for t in plan.towers) / GIB:.2f} GiB "
                 f"placed vs {plan.interleaved_cross_node_bytes / GIB:.2f} GiB interleaved")
    return "\n".join(lines)
