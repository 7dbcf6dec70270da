"""Alpha-beta network model: time of each collective per algorithm, and the transport's message-rate ceiling.

A collective over `n` ranks of which `g` share a node costs latency steps (alpha) plus bytes over the
slowest link (beta). Algorithms: ring (n-1 steps, (n-1)/n of the tensor per rank), tree (log2 n steps,
the whole tensor through each level), NVLS (NVSwitch in-switch reduction: each GPU sends and receives the
tensor once), and hierarchical (intra-node reduce-scatter, inter-node collective on 1/g of the tensor,
intra-node all-gather). `auto` takes the fastest, as NCCL's tuner roughly does.

Transport: inter-node GPU traffic is posted either by a CPU proxy thread (NCCL's and NVSHMEM's IBRC path:
the GPU writes a request to host memory, the proxy builds the work request and rings the NIC doorbell) or
by the GPU itself (IBGDA). A stream of `m`-byte messages moves at min(B, m * R) where R is the message
rate of whichever posts the work: the proxy thread, or the NIC. Parameters and sources are in
`NetworkParams` and docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orangetron.spec.hardware import Cluster


@dataclass(frozen=True)
class NetworkParams:
    """Constants of the network model; each documented with its public source in docs/planner.md."""

    intra_latency_s: float = 2.0e-6  # NCCL per-step latency over NVLink/NVSwitch (nccl-tests small sizes)
    inter_latency_s: float = 6.0e-6  # per-step latency across InfiniBand, incl. NCCL protocol overhead
    pcie_latency_s: float = 5.0e-6
    intra_efficiency: float = 0.80  # nccl-tests bus bandwidth / NVLink line rate (about 240 of 300 GB/s, A100)
    inter_efficiency: float = 0.90  # bus bandwidth / NIC line rate on InfiniBand NDR/HDR
    nvls_efficiency: float = 0.60  # NVLS all-reduce algorithm bandwidth / NVLink line rate (H100: ~270 of 450)
    nic_msg_rate: float = 215e6  # messages/s: ConnectX-6 product brief (215 M msg/s); CX-7 is higher
    proxy_msg_rate: float = 22e6  # messages/s one proxy thread posts (~45 ns/message: poll, WQE, doorbell)


DEFAULT_PARAMS = NetworkParams()


@dataclass(frozen=True)
class Placement:
    """A process group: `size` ranks, `per_node` of them on each of `nodes` nodes."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.per_node


def placement(size: int, stride: int, gpus_per_node: int) -> Placement:
    """Where a group of `size` ranks `stride` apart lands when ranks fill nodes in order."""
    if size <= 1:
        return Placement(1, 1)
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    return Placement(size, per_node)


def _intra(cluster: Cluster, p: NetworkParams) -> tuple[float, float]:
    lat = p.pcie_latency_s if cluster.gpu.intra_node == "pcie" else p.intra_latency_s
    return lat, cluster.gpu.intra_bw_gbs * 1e9 * p.intra_efficiency


def _inter(cluster: Cluster, p: NetworkParams) -> tuple[float, float]:
    return p.inter_latency_s, cluster.nic_bytes_per_s * p.inter_efficiency


def _ring(full: float, n: int, lat: float, bw: float, passes: int) -> float:
    return passes * ((n - 1) * lat + (n - 1) / n * full / bw)


def collective_time(op: str, full_bytes: float, where: Placement, cluster: Cluster, algorithm: str = "auto",
                    params: NetworkParams = DEFAULT_PARAMS) -> tuple[float, str]:
    """(seconds, algorithm) for all_gather / reduce_scatter / all_reduce of a `full_bytes` tensor."""
    n = where.size
    if n <= 1 or full_bytes <= 0:
        return 0.0, "none"
    passes = 2 if op == "all_reduce" else 1
    intra, inter = _intra(cluster, params), _inter(cluster, params)
    options: dict[str, float] = {}
    if where.nodes == 1:
        options["ring"] = _ring(full_bytes, n, *intra, passes)
        options["tree"] = passes * (math.ceil(math.log2(n)) * intra[0] + full_bytes / intra[1])
        if op == "all_reduce" and cluster.gpu.nvls:
            bw = cluster.gpu.intra_bw_gbs * 1e9 * params.nvls_efficiency
            options["nvls"] = 2 * intra[0] + full_bytes / bw
    else:
        # A flat ring crosses nodes; NCCL runs one ring per NIC so each rank sees its own NIC's bandwidth.
        slow = (inter[0], min(inter[1], intra[1]))
        options["ring"] = _ring(full_bytes, n, *slow, passes)
        options["tree"] = passes * (math.ceil(math.log2(n)) * inter[0] + full_bytes / slow[1])
        g, nodes = where.per_node, where.nodes
        if g > 1:
            inner = _ring(full_bytes, g, *intra, 1)
            outer = _ring(full_bytes / g, nodes, *inter, passes)
            options["hierarchical"] = (2 if op == "all_reduce" else 1) * inner + outer
    if algorithm != "auto":
        if algorithm not in options:
            raise ValueError(f"algorithm={algorithm!r} is not available for {op} over {n} ranks on "
                             f"{where.nodes} node(s); choose one of {', '.join(sorted(options))}")
        return options[algorithm], algorithm
    best = min(options, key=options.__getitem__)
    return options[best], best


def message_throughput(msg_bytes: float, cluster: Cluster, transport: str | None = None,
                       params: NetworkParams = DEFAULT_PARAMS) -> float:
    """Bytes/s of a stream of `msg_bytes` messages leaving one GPU over its NIC: min(line rate, m * R)."""
    kind = transport or cluster.transport
    rate = params.proxy_msg_rate if kind == "proxy" else params.nic_msg_rate
    return min(cluster.nic_bytes_per_s * params.inter_efficiency, msg_bytes * rate)


def all_to_all_time(sent_bytes: float, where: Placement, cluster: Cluster, msg_bytes: float,
                    params: NetworkParams = DEFAULT_PARAMS) -> float:
    """Seconds for an all-to-all in which this rank sends `sent_bytes` to the other ranks, evenly,
    in messages of `msg_bytes` (a token row for expert dispatch). Intra- and inter-node parts overlap."""
    n = where.size
    if n <= 1 or sent_bytes <= 0:
        return 0.0
    local_peers, remote_peers = where.per_node - 1, n - where.per_node
    per_peer = sent_bytes / (n - 1)
    lat, bw = _intra(cluster, params)
    t_local = lat + local_peers * per_peer / bw if local_peers else 0.0
    t_remote = 0.0
    if remote_peers:
        t_remote = params.inter_latency_s + remote_peers * per_peer / message_throughput(msg_bytes, cluster,
                                                                                         params=params)
    return max(t_local, t_remote)


def p2p_time(nbytes: float, inter_node: bool, cluster: Cluster, params: NetworkParams = DEFAULT_PARAMS) -> float:
    """Seconds for one point-to-point transfer (pipeline activations, ring-attention chunks)."""
    if nbytes <= 0:
        return 0.0
    lat, bw = _inter(cluster, params) if inter_node else _intra(cluster, params)
    return lat + nbytes / bw
