"""Node-deduplicated expert dispatch (`Job.dispatcher = "deepep"`): priced by the planner, not run.

DeepEP's normal kernels, and DeepSeek-V3's own all-to-all (arXiv:2412.19437 section 3.2.2), send a token over
RDMA once to each remote node holding one of its experts, to the GPU with the sender's local index there,
which forwards it over NVLink to the GPUs holding those experts; both legs run at once, and the combine
retraces the path. With top_k experts drawn at random from E spread evenly over N nodes of g GPUs, a token
reaches N * (1 - C(E - E/N, k) / C(E, k)) nodes; group-limited routing (DeepSeek-V3: at most 4 of 8 expert
groups, one group per node) draws them from the allowed nodes only (`ModelSpec.allowed_bins`). Of the nodes
reached, a share (N - 1)/N is remote. The NVLink leg carries every destination GPU's copy except the
forwarding GPU's own: (g - 1)/g of them. These are expectations under random routing; the ragged dispatcher's
records instead follow the runtime's balanced-routing convention (every token on `routed_ranks` ranks).

Bytes: a dispatched row is the token (FP8 with one float32 scale per 128 values under the blockwise FP8
recipe, which quantizes before the dispatch; the parameter dtype otherwise) plus its top_k expert ids
(int64) and weights (float32); a combined row is the expert output in the parameter dtype. Backward sends
the outputs' gradients the dispatch way and the inputs' gradients the combine way, in the same dtypes.
The kernels occupy `Job.ep_comm_sms` SMs while they run, so compute overlapping them slows by that share
(`sm_share`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from orangetron.plan.config import Job
from orangetron.plan.hardware import Cluster
from orangetron.plan.models import ModelSpec
from orangetron.plan.network import NetworkParams, Placement, message_throughput, p2p_time

FP8_TILE = 128  # values per float32 scale in the blockwise recipe's activation tiles


@dataclass(frozen=True)
class Fanout:
    """Where one token's copies go, on average: remote nodes over RDMA, destination GPUs over NVLink."""

    remote_nodes: float
    nvlink_rows: float


def reach(experts: int, top_k: int, bins: int, pool: int = 0) -> float:
    """Expected bins (nodes or GPUs) holding at least one of `top_k` experts drawn at random from the
    experts of `pool` of `bins` equal bins (0: all of them)."""
    pool = pool or bins
    per_bin = experts // bins
    drawn = per_bin * pool
    return pool * (1 - comb(drawn - per_bin, top_k) / comb(drawn, top_k))


def fanout(model: ModelSpec, where: Placement) -> Fanout:
    """Per token: remote node copies and NVLink rows, over the EP group `where` (experts spread evenly)."""
    nodes, g = where.nodes, where.per_node
    nodes_reached = reach(model.num_experts, model.top_k, nodes, model.allowed_bins(nodes))
    gpus_reached = reach(model.num_experts, model.top_k, where.size, model.allowed_bins(where.size))
    return Fanout(nodes_reached * (nodes - 1) / nodes, gpus_reached * (g - 1) / g)


def row_bytes(model: ModelSpec, job: Job) -> tuple[int, int]:
    """(dispatched, combined) bytes per token row."""
    h = model.hidden_size
    blockwise_fp8 = job.fp8 and job.fp8_recipe == "blockwise"
    token = h + 4 * -(-h // FP8_TILE) if blockwise_fp8 else job.param_bytes * h
    return token + 12 * model.top_k, job.param_bytes * h


def passes(job: Job) -> int:
    """Forward passes per micro-batch: one, two when full recompute replays the forward."""
    return 2 if job.recompute == "full" else 1


def bytes_sent(model: ModelSpec, where: Placement, job: Job, tokens: int) -> list[int]:
    """Bytes one rank sends per MoE layer and micro-batch, one entry per dispatch or combine, in order."""
    f = fanout(model, where)
    per_token = f.remote_nodes + f.nvlink_rows
    dispatch, combine = (round(tokens * per_token * b) for b in row_bytes(model, job))
    return [dispatch, combine] * passes(job) + [dispatch, combine]


def layer_time(model: ModelSpec, where: Placement, job: Job, tokens: int, cluster: Cluster,
               net: NetworkParams) -> float:
    """Seconds of one MoE layer's dispatches and combines for one micro-batch: each the slower of its RDMA
    leg (message-rate bound, a row per message) and its NVLink leg."""
    if where.size == 1:
        return 0.0
    f = fanout(model, where)
    total = 0.0
    for row in row_bytes(model, job):
        rdma = 0.0
        if f.remote_nodes:
            rdma = net.inter_latency_s + tokens * f.remote_nodes * row / message_throughput(row, cluster, params=net)
        nvlink = p2p_time(tokens * f.nvlink_rows * row, False, cluster, net)
        total += max(rdma, nvlink)
    return total * (passes(job) + 1)


def sm_share(job: Job, cluster: Cluster) -> float:
    """Share of the GPU the dispatch kernels hold while they run: compute hiding them runs on (S - s)/S of
    the SMs, so hiding `t` seconds of traffic costs s/S * t."""
    if job.ep_comm_sms >= cluster.gpu.sms:
        raise ValueError(f"ep_comm_sms={job.ep_comm_sms}: the {cluster.gpu.name} has {cluster.gpu.sms} SMs")
    return job.ep_comm_sms / cluster.gpu.sms
