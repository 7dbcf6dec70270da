"""Node-deduplicated expert dispatch (`Job.dispatcher = "deepep"`): priced by the planner, not run.

DeepEP's normal kernels, and DeepSeek-V3's own all-to-all (arXiv:2412.19437 section 3.2.2), send a token over
RDMA once to each remote node holding one of its experts, to the GPU with the sender's local index there,
which forwards it over NVLink to the GPUs holding those experts; both legs run at once, and the combine
retraces the path. With top_k experts drawn uniformly from E spread evenly over N nodes of g GPUs, a token
reaches N * (1 - C(E - E/N, k) / C(E, k)) nodes; under group-limited routing (DeepSeek-V3: 4 of 8 expert
groups, one group per node) the experts are drawn from the groups chosen, the groups uniformly (`reach`, exact
for any split of groups over nodes). A router that picks groups by their scores spreads a token's experts
over its groups more evenly than that, so these counts are a lower bound. Of the nodes reached, a share
(N - 1)/N is remote. The NVLink leg carries every destination GPU's copy except the forwarding GPU's own:
(g - 1)/g of them. The ragged dispatcher's records instead follow the runtime's balanced-routing convention
(every token on `routed_ranks` ranks, the most it can reach).

Bytes: a dispatched row is the token (FP8 with one float32 scale per 128 values under the blockwise FP8
recipe, which quantizes before the dispatch; the parameter dtype otherwise), forward with its top_k expert
indices and weights; a combined row is the expert output in the parameter dtype. Backward sends the outputs'
gradients the dispatch way and the inputs' gradients the combine way, in the same dtypes. The kernels hold
`Job.ep_comm_sms` SMs while they run (not for the whole step), so compute overlapping them slows by that
share (`sm_share`); with fewer than the 20 SMs DeepSeek-V3 found to saturate both links they slow in
proportion.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from math import comb

from orangetron.plan.fp8 import ACTIVATION_TILE
from orangetron.plan.network import NetworkParams, Placement, message_throughput, p2p_time
from orangetron.spec.hardware import Cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Job

# DeepSeek-V3 (arXiv:2412.19437 section 3.2.2): "only 20 SMs are sufficient to fully utilize the bandwidths of IB
# and NVLink"; with fewer, the transfers slow in proportion
FULL_RATE_SMS = 20


@dataclass(frozen=True)
class Fanout:
    """Where one token's copies go, on average: remote nodes over RDMA, destination GPUs over NVLink."""

    remote_nodes: float
    nvlink_rows: float


def reach(experts: int, top_k: int, bins: int, groups: int = 0, per_token: int = 0) -> float:
    """Expected bins (nodes or GPUs: equal contiguous slices of the experts) holding at least one of a token's
    top_k experts, drawn uniformly from all experts, or under group-limited routing from the experts of
    `per_token` of `groups` equal contiguous groups chosen uniformly."""
    if not 0 < per_token < groups:
        return bins * (1 - comb(experts - experts // bins, top_k) / comb(experts, top_k))
    return sum(_bin_hit(experts, top_k, bins, groups, per_token, b) for b in range(bins))


@lru_cache(maxsize=65536)
def _bin_hit(experts: int, top_k: int, bins: int, groups: int, per_token: int, b: int) -> float:
    """Chance that bin `b` holds one of the token's experts: over how many of the groups it overlaps are
    chosen (whole groups inside it, by count; the at most two it shares with neighbours, one by one)."""
    group, width = experts // groups, experts // bins
    lo, hi = b * width, (b + 1) * width
    overlaps = [min(hi, (j + 1) * group) - max(lo, j * group) for j in range(lo // group, -(-hi // group))]
    whole = sum(o == group for o in overlaps)
    parts = [o for o in overlaps if o != group]
    pool, ways = per_token * group, comb(groups, per_token)
    hit = 0.0
    for chosen in itertools.product((0, 1), repeat=len(parts)):
        partial = sum(o for o, c in zip(parts, chosen, strict=True) if c)
        for r in range(whole + 1):
            rest = per_token - r - sum(chosen)
            if rest < 0:
                continue
            p = comb(whole, r) * comb(groups - len(overlaps), rest) / ways
            hit += p * (1 - comb(pool - r * group - partial, top_k) / comb(pool, top_k))
    return hit


def fanout(model: ModelSpec, where: Placement) -> Fanout:
    """Per token: remote node copies and NVLink rows, over the EP group `where` (experts spread evenly)."""
    nodes, per_node = where.nodes, where.per_node
    limit = (model.expert_groups, model.groups_per_token) if model.group_limited else (0, 0)
    nodes_reached = reach(model.num_experts, model.top_k, nodes, *limit)
    gpus_reached = reach(model.num_experts, model.top_k, where.size, *limit)
    return Fanout(nodes_reached * (nodes - 1) / nodes, gpus_reached * (per_node - 1) / per_node)


def row_bytes(model: ModelSpec, job: Job) -> tuple[int, int, int]:
    """(forward dispatch, backward dispatch, combine) bytes per token row. The forward dispatch carries the
    token's top_k expert indices and weights, 4 bytes each; the backward one, routed by the forward's layout,
    sends the gradient alone."""
    h = model.hidden_size
    blockwise_fp8 = job.fp8 and job.fp8_recipe == "blockwise"
    token = h + 4 * -(-h // ACTIVATION_TILE) if blockwise_fp8 else job.param_bytes * h
    return token + 8 * model.top_k, token, job.param_bytes * h


def passes(job: Job) -> int:
    """Forward passes per micro-batch: one, two when full recompute replays the forward."""
    return 2 if job.recompute == "full" else 1


def _transfers(model: ModelSpec, job: Job) -> list[int]:
    """Row bytes of each dispatch or combine of one MoE layer and micro-batch, in order."""
    forward, backward, combine = row_bytes(model, job)
    return [forward, combine] * passes(job) + [backward, combine]


def bytes_sent(model: ModelSpec, where: Placement, job: Job, tokens: int) -> list[int]:
    """Bytes one rank sends per MoE layer and micro-batch, one entry per dispatch or combine, in order."""
    f = fanout(model, where)
    return [round(tokens * (f.remote_nodes + f.nvlink_rows) * row) for row in _transfers(model, job)]


def check_placement(where: Placement, span: int, cluster: Cluster) -> None:
    """DeepEP pairs ranks of the same local index across nodes and forwards over one node's NVLink, so every EP
    group must be whole nodes or lie inside one: `span` is the run of consecutive ranks one group covers."""
    gpus = cluster.gpus_per_node
    whole_nodes = where.size % gpus == 0 and where.per_node == gpus
    inside_one = where.per_node == where.size and gpus % span == 0
    if not (whole_nodes or inside_one):
        raise ValueError(f"dispatcher 'deepep' needs EP groups of whole nodes or inside one: this layout's groups of "
                         f"{where.size} ranks span {span} consecutive ranks, {where.per_node} of them on a node of "
                         f"{gpus} GPUs; make tp x ep fill whole nodes or divide one, or use another dispatcher")


def layer_time(model: ModelSpec, where: Placement, job: Job, tokens: int, cluster: Cluster,
               net: NetworkParams) -> float:
    """Seconds of one MoE layer's dispatches and combines for one micro-batch: each the slower of its RDMA
    leg (message-rate bound, a row per message) and its NVLink leg, slowed when its kernels have fewer SMs
    than the `FULL_RATE_SMS` that saturate both."""
    if where.size == 1:
        return 0.0
    f = fanout(model, where)
    total = 0.0
    for row in _transfers(model, job):
        rdma = 0.0
        if f.remote_nodes:
            rdma = net.inter_latency_s + tokens * f.remote_nodes * row / message_throughput(row, cluster, params=net)
        nvlink = p2p_time(tokens * f.nvlink_rows * row, False, cluster, net)
        total += max(rdma, nvlink)
    return total / min(1.0, job.ep_comm_sms / FULL_RATE_SMS)


def sm_share(job: Job, cluster: Cluster) -> float:
    """Share of the GPU the dispatch kernels hold while they run: compute hiding them runs on (S - s)/S of
    the SMs, so hiding `t` seconds of traffic costs s/S * t."""
    if job.ep_comm_sms >= cluster.gpu.sms:
        raise ValueError(f"ep_comm_sms={job.ep_comm_sms}: the {cluster.gpu.name} has {cluster.gpu.sms} SMs")
    return job.ep_comm_sms / cluster.gpu.sms
