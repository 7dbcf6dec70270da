"""Host pacing of MoE layers (`plan/host.py`): the operations a MoE layer issues, counted by hand from the
documented constants, and a layer that runs at the slower of its GPU time and its host time, pass by pass."""

from dataclasses import replace

import pytest

from orangetron.plan import host
from orangetron.plan.timing import DEFAULT_EFFICIENCY, layer_cost, step_time
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import load_model
from orangetron.spec.options import Degrees, Job

QWEN = load_model("qwen3-30b-a3b")  # 128 experts, top 8: 16 local experts over ep 8


def test_operations_by_hand():
    """36 shared forward operations (38 with Qwen3's QK-norm: a norm over the query heads and one over the key
    heads), twice as many backward; per local expert 2 GEMMs forward and 4 backward (dgrad and wgrad of each
    projection), plus one FP8 cast per GEMM input forward and per output gradient backward."""
    deg, shared = Degrees(dp=8, ep=8), 36 + 2
    assert host.layer_ops(QWEN, deg, Job(seq_len=4096)) == (shared + 16 * 2, 2 * shared + 16 * 4)
    assert host.layer_ops(replace(QWEN, qk_norm=False), deg, Job(seq_len=4096)) == (36 + 16 * 2, 72 + 16 * 4)
    assert host.layer_ops(QWEN, deg, Job(seq_len=4096, fp8=True)) == (shared + 16 * 4, 2 * shared + 16 * 6)
    # A blockwise cast is one kernel too; current scaling issues three per cast (amax, scale, cast).
    assert host.layer_ops(QWEN, deg, Job(seq_len=4096, fp8=True, fp8_recipe="blockwise")) == \
        (shared + 16 * 4, 2 * shared + 16 * 6)
    assert host.layer_ops(QWEN, deg, Job(seq_len=4096, fp8=True, fp8_recipe="current")) == \
        (shared + 16 * 2 * (1 + 3), 2 * shared + 16 * 2 * (2 + 3))
    # Chunked dispatch runs each chunk's experts as their own GEMMs; ep 1 holds every expert.
    assert host.layer_ops(QWEN, deg, Job(seq_len=4096, ep_overlap_chunks=2)) == (shared + 32 * 2, 2 * shared + 32 * 4)
    assert host.layer_ops(QWEN, Degrees(dp=8), Job(seq_len=4096)) == (shared + 128 * 2, 2 * shared + 128 * 4)


def test_each_pass_takes_the_slower_of_gpu_and_host():
    deg, job, op = Degrees(dp=8, ep=8), Job(seq_len=4096), 10e-6
    forward, backward = 70 * op, 140 * op
    assert host.paced_seconds(1.0, 2.0, QWEN, deg, job, op) == 3.0  # GPU-bound: untouched
    assert host.paced_seconds(0.0, 0.0, QWEN, deg, job, op) == pytest.approx(forward + backward)
    # A GPU-bound forward does not lend its slack to a host-bound backward.
    assert host.paced_seconds(1.0, 0.0, QWEN, deg, job, op) == pytest.approx(1.0 + backward)
    # Full recompute issues the forward again during backward.
    full = replace(job, recompute="full")
    assert host.paced_seconds(0.0, 0.0, QWEN, deg, full, op) == pytest.approx(2 * forward + backward)


def test_fine_grained_experts_at_few_tokens_wait_for_the_host_and_large_layers_do_not():
    """Qwen3-30B-A3B at 4096 tokens on 8 B200 under FP8 (a GPU pass well under the host's 100 + 168 operations
    of the fitted 50 us): the step slows by the host's share. Mixtral's one local expert per GPU at the same
    tokens keeps its GPU busy longer than its host takes, and keeps its time."""
    no_host = replace(DEFAULT_EFFICIENCY, host_op_s=0.0)
    b200 = make_cluster("b200", 8)
    deg, fp8 = Degrees(dp=8, ep=8), Job(seq_len=4096, global_batch=64, fp8=True)
    cost = layer_cost(QWEN, deg, fp8, b200, True)
    assert cost.forward < 100 * DEFAULT_EFFICIENCY.host_op_s  # the premise: its forward is shorter than its host's
    paced, free = step_time(QWEN, deg, fp8, b200), step_time(QWEN, deg, fp8, b200, eff=no_host)
    assert paced.compute_s > 1.2 * free.compute_s
    mixtral, h100 = load_model("mixtral-8x7b"), make_cluster("h100", 8)
    bf16 = Job(seq_len=4096, global_batch=64)
    assert step_time(mixtral, deg, bf16, h100).step_s == step_time(mixtral, deg, bf16, h100, eff=no_host).step_s
