"""Network model: alpha-beta collectives per algorithm, and the CPU-proxy vs IBGDA message-rate model.

IBGDA source: NVIDIA Technical Blog, "Improving Network Performance of HPC Systems Using NVIDIA Magnum IO
NVSHMEM and GPUDirect Async" (2022): GPU-initiated transfers reach up to 9.5x the throughput of the CPU-proxy
path for small messages, most of the gain below 1 KiB, the two converging for large messages (docs/planner.md
section 5 uses this). Our parameters (NetworkParams: NIC message rate 215 M/s from the ConnectX-6
product brief; one proxy thread about 22 M messages/s) are documented in docs/planner.md, not fitted here.
"""

import pytest

from orangetron.plan.network import (
    Placement,
    all_to_all_time,
    collective_time,
    message_throughput,
    placement,
)
from orangetron.spec.hardware import make_cluster

CLUSTER = make_cluster("h100", 64)


@pytest.mark.parametrize("size", [8, 16, 64, 128])
def test_ibgda_small_message_gap_is_an_order_of_magnitude(size):
    ratio = message_throughput(size, CLUSTER, "ibgda") / message_throughput(size, CLUSTER, "proxy")
    assert 8.0 <= ratio <= 10.5  # "up to 9.5x"


def test_ibgda_gap_shrinks_and_closes_for_large_messages():
    sizes = [2**k for k in range(3, 25)]  # 8 B .. 16 MiB
    ratios = [message_throughput(s, CLUSTER, "ibgda") / message_throughput(s, CLUSTER, "proxy") for s in sizes]
    assert all(a >= b for a, b in zip(ratios, ratios[1:], strict=False))  # never widens with size
    assert ratios[sizes.index(1024)] > 1.5  # still a clear gain at 1 KiB
    assert ratios[sizes.index(1 << 20)] == pytest.approx(1.0)  # 1 MiB: both at line rate
    assert message_throughput(1 << 20, CLUSTER, "proxy") == pytest.approx(0.9 * 50e9)


def test_token_level_ep_pays_for_small_messages_only_with_proxy():
    where = Placement(size=64, per_node=8)
    sent = 64 * 2**20
    small_proxy = all_to_all_time(sent, where, CLUSTER, msg_bytes=256)
    small_gpu = all_to_all_time(sent, where, make_cluster("h100", 64, transport="ibgda"), msg_bytes=256)
    big_proxy = all_to_all_time(sent, where, CLUSTER, msg_bytes=14336)
    assert small_proxy > 5 * small_gpu
    assert big_proxy == pytest.approx(all_to_all_time(sent, where, make_cluster("h100", 64, transport="ibgda"),
                                                      msg_bytes=14336))


def test_placement_follows_rank_order():
    assert placement(8, 1, 8) == Placement(8, 8)  # tp inside a node
    assert placement(16, 8, 8) == Placement(16, 1)  # dp across nodes, one rank per node
    assert placement(8, 2, 8) == Placement(8, 4)  # cp with tp=2: 4 per node on 2 nodes
    assert placement(1, 4, 8).nodes == 1


def test_ring_all_reduce_is_twice_all_gather_for_large_tensors():
    where = Placement(8, 8)
    ag, _ = collective_time("all_gather", 1 << 30, where, CLUSTER, "ring")
    ar, _ = collective_time("all_reduce", 1 << 30, where, CLUSTER, "ring")
    assert ar == pytest.approx(2 * ag)
    # 1 GiB over 8 ranks at 0.8 x 450 GB/s: 7/8 GiB / 360 GB/s
    assert ag == pytest.approx(7 * 2e-6 + (7 / 8) * 2**30 / 360e9)


def test_nvls_wins_large_all_reduce_on_h100_but_is_absent_on_a100():
    where = Placement(8, 8)
    _, algo = collective_time("all_reduce", 1 << 30, where, CLUSTER)
    assert algo == "nvls"
    _, algo = collective_time("all_reduce", 1 << 30, where, make_cluster("a100-80gb", 8))
    assert algo == "ring"
    with pytest.raises(ValueError, match="nvls"):
        collective_time("all_reduce", 1 << 20, where, make_cluster("a100-80gb", 8), "nvls")


def test_tree_wins_small_messages_and_hierarchical_wins_across_nodes():
    _, algo = collective_time("all_reduce", 1024, Placement(64, 8), CLUSTER)
    assert algo == "tree"
    _, algo = collective_time("all_reduce", 1 << 30, Placement(64, 8), CLUSTER)
    assert algo == "hierarchical"


def test_pcie_node_is_slower_than_nvswitch():
    where = Placement(4, 4)
    pcie, _ = collective_time("all_reduce", 1 << 28, where, make_cluster("rtx3090", 4))
    nvlink, _ = collective_time("all_reduce", 1 << 28, where, make_cluster("a100-80gb", 4))
    assert pcie > 8 * nvlink


def test_group_of_one_costs_nothing():
    assert collective_time("all_reduce", 1 << 20, Placement(1, 1), CLUSTER) == (0.0, "none")
