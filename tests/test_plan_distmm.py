"""DistMM planner (Huang et al., NSDI 2024) on the shipped dual-encoder presets."""

import pytest

from orangetron.plan.distmm import best_tower_plan, format_plan, plan_distmm
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import load_model


@pytest.fixture(scope="module")
def clip_plan():
    return plan_distmm(load_model("clip-vit-bigg14"), make_cluster("a100-80gb", 32), 2048)


def test_every_gpu_is_assigned_once(clip_plan):
    assert sum(t.gpus for t in clip_plan.towers) == 32
    starts = sorted((t.first_gpu, t.gpus) for t in clip_plan.towers)
    assert starts[0][0] == 0 and starts[1][0] == starts[0][1]
    for t in clip_plan.towers:
        assert t.tp * t.pp * t.dp == t.gpus


def test_load_balancer_beats_an_even_split(clip_plan):
    """The slowest tower is no slower than with half the GPUs each (the paper's load-balancing goal)."""
    spec, cluster = load_model("clip-vit-bigg14"), make_cluster("a100-80gb", 32)
    limit = 0.9 * cluster.gpu.memory_bytes
    even = max(best_tower_plan(n, t, cluster, 16, 2048, "bfloat16", limit).time_s for n, t in spec.towers.items())
    assert clip_plan.step_s <= even
    # CLIP's image tower is the heavy one: it gets the larger share.
    by_name = {t.name: t for t in clip_plan.towers}
    assert by_name["image"].gpus > by_name["text"].gpus


def test_placement_keeps_traffic_local(clip_plan):
    assert sum(t.cross_node_bytes for t in clip_plan.towers) <= clip_plan.interleaved_cross_node_bytes


def test_gain_and_report(clip_plan):
    assert clip_plan.gain == pytest.approx(clip_plan.baseline_step_s / clip_plan.step_s)
    text = format_plan(clip_plan)
    assert "predicted gain" in text and "image" in text
    data = clip_plan.to_json()
    assert data["recommend"] in ("distmm", "colocated") and len(data["towers"]) == 2


def test_lit_gives_the_text_tower_more_gpus():
    plan = plan_distmm(load_model("lit-b16-text-g"), make_cluster("h100", 16), 2048)
    by_name = {t.name: t for t in plan.towers}
    assert by_name["text"].gpus > by_name["image"].gpus


def test_impossible_batch_is_a_value_error():
    with pytest.raises(ValueError, match="no split"):
        plan_distmm(load_model("clip-vit-bigg14"), make_cluster("rtx3090", 2), 1)


def test_no_tower_gets_more_replicas_than_sequences():
    """At a batch of 1 a tower planned 2 replicas (and the colocated baseline 4): a replica with no sample."""
    plan = plan_distmm(load_model("lit-b16-text-g"), make_cluster("h100", 16), 1)
    assert all(t.dp == 1 for t in plan.towers)
    assert plan.gain is None and plan.to_json()["predicted_gain"] is None  # no colocated layout runs 1 sequence
    assert "no colocated layout of 16 GPUs runs 1 sequences" in format_plan(plan)
