"""Layout validation (one test per rule) and rank <-> coordinate mapping against hand-written tables."""

import pytest

from orangetron.spec.layout import Layout, LayoutError
from orangetron.spec.model import ModelSpec


def model(**overrides):
    fields = dict(name="m", hidden_size=64, num_heads=8, num_kv_heads=4, num_layers=4, vocab_size=256,
                  ffn_hidden_size=64, num_experts=8, top_k=2, moe_ffn_hidden_size=32)
    return ModelSpec(**{**fields, **overrides})


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(tp=0), r"tp=0: degree must be a positive integer"),
        (dict(cp=-2), r"cp=-2: degree must be a positive integer"),
        (dict(dp=1.5), r"dp=1.5: degree must be a positive integer"),
        (dict(pp=True), r"pp=True: degree must be a positive integer"),
        (dict(etp=2), r"etp=2: expert tensor parallelism must be 1 or tp=1"),
        (dict(dp=2, cp=3, ep=4), r"ep=4: dp\*cp=6 .* not divisible by ep"),
    ],
)
def test_degree_rules(kwargs, pattern):
    with pytest.raises(LayoutError, match=pattern):
        Layout(**kwargs)


@pytest.mark.parametrize(
    "layout, cfg, pattern",
    [
        (Layout(tp=3), model(num_heads=8), r"tp=3: n_heads=8 is not divisible by tp"),
        (Layout(tp=4), model(num_heads=8, num_kv_heads=2), None),  # kv heads replicated over tp
        (Layout(tp=8, dp=1), model(hidden_size=192, num_heads=24, num_kv_heads=3), r"n_kv_heads=3 must divide tp"),
        (Layout(pp=3), model(num_layers=4), None),  # two, one and one layers, as the planner splits them
        (Layout(pp=5), model(num_layers=4), r"pp=5: num_layers=4 < pp; every stage needs a layer"),
        (Layout(dp=2, ep=2), model(num_experts=0, top_k=0), r"ep=2: the model has no experts"),
        (Layout(dp=4, ep=4), model(num_experts=6), r"ep=4: n_experts=6 is not divisible by ep"),
        # experts that no layer holds (every layer dense): ep would split nothing
        (Layout(dp=2, ep=2), model(num_experts=4, first_dense_layers=8), r"ep=2: no layer of the model has its"),
        (Layout(dp=2, ep=2), model(num_experts=4, moe_layer_freq=9), r"ep=2: no layer of the model has its"),
        (Layout(tp=2), model(vocab_size=255, num_heads=8), r"tp=2: vocab_size=255 is not divisible by tp"),
    ],
)
def test_model_rules(layout, cfg, pattern):
    if pattern is None:
        layout.validate(cfg)
        return
    with pytest.raises(LayoutError, match=pattern):
        layout.validate(cfg)


def test_sequence_rules():
    with pytest.raises(LayoutError, match=r"cp=3: seq_len 1000 is not divisible by 2\*cp=6"):
        Layout(cp=3).validate(seq_len=1000)
    with pytest.raises(LayoutError, match=r"tp=4: sequence_parallel needs seq_len/cp=6 divisible by tp"):
        Layout(tp=4, cp=2).validate(seq_len=12, sequence_parallel=True)
    with pytest.raises(LayoutError, match=r"seq_len=0: must be positive"):
        Layout().validate(seq_len=0)
    Layout(cp=3).validate(seq_len=1002)
    Layout(tp=4).validate(seq_len=6)  # without SP, tp does not constrain the sequence


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_world_size_and_edp():
    layout = Layout(tp=2, cp=2, pp=3, dp=2, ep=2)
    assert layout.world_size == 24
    assert layout.edp == 2
    assert str(layout) == "tp=2 cp=2 pp=3 dp=2 ep=2"


# (layout, rank) -> (tp, cp, dp, pp, dp_cp, ep, edp), worked out by hand from the tp-cp-ep-dp-pp order.
COORDINATE_TABLE = [
    (Layout(tp=2, dp=2, pp=2), 0, (0, 0, 0, 0, 0, 0, 0)),
    (Layout(tp=2, dp=2, pp=2), 3, (1, 0, 1, 0, 1, 0, 1)),
    (Layout(tp=2, dp=2, pp=2), 6, (0, 0, 1, 1, 1, 0, 1)),
    (Layout(tp=2, dp=2, pp=2), 7, (1, 0, 1, 1, 1, 0, 1)),
    (Layout(tp=2, cp=2, dp=2, ep=2), 2, (0, 1, 0, 0, 1, 1, 0)),
    (Layout(tp=2, cp=2, dp=2, ep=2), 5, (1, 0, 1, 0, 2, 0, 1)),
    (Layout(tp=2, cp=2, dp=2, ep=2), 6, (0, 1, 1, 0, 3, 1, 1)),
    (Layout(cp=4, dp=2, ep=4), 5, (0, 1, 1, 0, 5, 1, 1)),
    (Layout(cp=4, dp=2, ep=4), 3, (0, 3, 0, 0, 3, 3, 0)),
    (Layout(tp=4, pp=2), 6, (2, 0, 0, 1, 0, 0, 0)),
]


@pytest.mark.parametrize("layout, rank, expected", COORDINATE_TABLE)
def test_coordinates(layout, rank, expected):
    c = layout.coordinates(rank)
    assert (c.tp, c.cp, c.dp, c.pp, c.dp_cp, c.ep, c.edp) == expected
    assert layout.rank(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == rank


def test_coordinates_are_a_bijection():
    layout = Layout(tp=2, cp=3, pp=2, dp=2, ep=3)
    seen = {(c.tp, c.cp, c.dp, c.pp) for c in map(layout.coordinates, range(layout.world_size))}
    assert len(seen) == layout.world_size


def test_rank_out_of_range():
    with pytest.raises(LayoutError, match=r"rank=8: must lie in \[0, world_size=8\)"):
        Layout(tp=2, dp=4).coordinates(8)
    with pytest.raises(LayoutError, match=r"cp=1: coordinate must lie in \[0, 1\)"):
        Layout(tp=2).rank(cp=1)


# ---- folded expert mesh (planner only) ------------------------------------------------------------
@pytest.mark.parametrize("layout, rank, expected", [
    # tp=4 attention, experts over all 8 ranks of the stage: ep is the rank itself, one replica.
    (Layout(tp=4, dp=2, ep=8, expert_fold=True), 5, (5, 0, 0)),
    # etp=2 fastest, then ep=2, then edp=2 over 8 ranks: rank 6 = etp 0, ep 1, edp 1.
    (Layout(tp=2, dp=4, ep=2, etp=2, expert_fold=True), 6, (1, 1, 0)),
    (Layout(tp=2, dp=4, ep=2, etp=2, expert_fold=True), 3, (1, 0, 1)),
    # Two pipeline stages of 4 ranks: the fold restarts in every stage (rank 7 is stage 1's fourth rank).
    (Layout(tp=2, pp=2, dp=2, ep=4, expert_fold=True), 7, (3, 0, 0)),
    # cp folds in too: tp=2 x cp=2 x dp=2, ep=4, edp=2: rank 5 is ep 1, edp 1.
    (Layout(tp=2, cp=2, dp=2, ep=4, expert_fold=True), 5, (1, 1, 0)),
])
def test_folded_expert_coordinates(layout, rank, expected):
    c = layout.coordinates(rank)
    assert (c.ep, c.edp, c.etp) == expected
    assert layout.rank(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == rank  # the dense coordinates are unchanged


def test_folded_expert_degrees_and_errors():
    layout = Layout(tp=4, cp=2, dp=2, ep=4, etp=2, expert_fold=True)
    assert layout.edp == 2 and layout.expert_mesh_shape() == (1, 2, 4, 2)
    assert str(layout) == "tp=4 cp=2 pp=1 dp=2 ep=4 etp=2 edp=2 (folded)"
    # experts split over tp without folding price apart from whole ones: estimate's header read alike for both
    assert str(Layout(tp=2, dp=4, ep=4, etp=2)) == "tp=2 cp=1 pp=1 dp=4 ep=4 etp=2"
    assert str(Layout(tp=2, dp=4, ep=4)) == "tp=2 cp=1 pp=1 dp=4 ep=4"
    with pytest.raises(LayoutError, match=r"ep=3 x etp=1: must divide the tp\*cp\*dp=8 ranks"):
        Layout(tp=4, dp=2, ep=3, expert_fold=True)
    with pytest.raises(LayoutError, match="needs ep or etp above 1"):
        Layout(tp=4, dp=2, expert_fold=True)
    with pytest.raises(LayoutError, match="a folded expert mesh, planner only, lifts this"):
        Layout(tp=4, dp=2, ep=8)


def test_node_placement_says_which_groups_stay_inside_a_node() -> None:
    """Nodes hold consecutive ranks; tp is fastest, so it stays inside a node when the node size divides by tp."""
    assert Layout(tp=2, dp=2).node_placement(2) == "2 node(s) of 2 ranks: tp inside a node; dp across nodes"
    assert Layout(tp=4).node_placement(2) == "2 node(s) of 2 ranks: tp across nodes"
    assert Layout(tp=2, cp=2, pp=2).node_placement(4) == "2 node(s) of 4 ranks: tp, cp inside a node; pp across nodes"
    assert Layout(tp=2, dp=4, ep=2).node_placement(4) == \
        "2 node(s) of 4 ranks: tp, ep inside a node; dp across nodes"  # ep groups: consecutive dp ranks
    assert Layout(dp=4).node_placement(4) == "1 node(s) of 4 ranks: dp inside a node"
    assert Layout(tp=2).node_placement(1) == "2 node(s) of 1 rank: tp across nodes"  # was "of 1 ranks"
    with pytest.raises(LayoutError, match="ranks_per_node=3: must divide world_size=4"):
        Layout(dp=4).node_placement(3)
