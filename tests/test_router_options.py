"""Router options: z-loss, group-limited top-k (max or top-2-sum group scores), the auxiliary-loss-free bias,
the routed scaling factor, sigmoid weights with and without renormalization, and the shared-expert gate.

Hand-worked values for each formula, then every option under layouts that split the tokens (dp, tp with
SP, cp, ep) against the plain single-device model with the same options and against the planner.
"""

from __future__ import annotations

import math

import pytest
import torch
from layout_check import check_layout, layout_run

from orangetron.model import ConfigError, ModelConfig
from orangetron.model.moe import Router, choose_experts
from orangetron.parallel import ParallelConfig
from orangetron.parallel.expert import update_router_bias
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, moe_ffn_dim=8)
MODELS = {
    "z-loss": ModelConfig(**BASE, n_experts=4, top_k=2, aux_loss_coef=0.05, router_z_loss_coef=0.1),
    "z-only-groups": ModelConfig(**BASE, n_experts=8, top_k=2, aux_loss_coef=0.0, router_z_loss_coef=0.2,
                                 n_expert_groups=4, topk_groups=2, router_score="sigmoid", norm_topk_prob=True),
    # A large rate so that the bias changes the routing within the test's few steps.
    "bias": ModelConfig(**BASE, n_experts=4, top_k=2, aux_loss_coef=0.0, router_bias_rate=0.05),
    "everything": ModelConfig(**BASE, n_experts=8, top_k=2, aux_loss_coef=0.05, router_z_loss_coef=0.1,
                              n_expert_groups=2, topk_groups=1, router_bias_rate=0.02, n_shared_experts=1),
    # Dots1's router (sigmoid, top-2-sum groups, correction bias, scaling, no renormalization) with Qwen2-MoE's
    # gated shared expert.
    "dots1-gated": ModelConfig(**BASE, n_experts=8, top_k=2, aux_loss_coef=0.0, router_score="sigmoid",
                               n_expert_groups=4, topk_groups=2, group_score="top2_sum", router_bias_rate=0.02,
                               routed_scaling_factor=2.5, n_shared_experts=1, shared_expert_gate=True),
}
CASES = {
    2: [("z-loss", Layout(dp=2), {"zero_stage": 1}),
        ("z-loss", Layout(tp=2), {"sequence_parallel": True}),
        ("z-loss", Layout(cp=2), {"cp_mode": "ring"}),
        ("z-only-groups", Layout(dp=2, ep=2), {"dispatcher": "ragged"}),
        ("z-only-groups", Layout(cp=2), {"cp_mode": "ulysses"}),
        ("bias", Layout(dp=2), {"zero_stage": 1}),
        ("bias", Layout(tp=2), {"sequence_parallel": True}),
        ("bias", Layout(dp=2, ep=2), {"dispatcher": "allgather"}),
        ("dots1-gated", Layout(dp=2, ep=2), {"dispatcher": "ragged"}),
        ("dots1-gated", Layout(tp=2), {"sequence_parallel": True})],
    4: [("everything", Layout(dp=2, ep=2, cp=2), {"dispatcher": "ragged", "cp_mode": "ring", "zero_stage": 1}),
        ("everything", Layout(tp=2, dp=2, ep=2), {"dispatcher": "ragged", "sequence_parallel": True}),
        ("dots1-gated", Layout(tp=2, dp=2, ep=2), {"dispatcher": "ragged", "sequence_parallel": True})],
}


def _router(cfg: ModelConfig, weight: list[list[float]]) -> Router:
    router = Router(cfg).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor(weight, dtype=torch.float64))
    return router


def test_z_loss_is_the_mean_squared_logsumexp_over_non_padding_tokens():
    cfg = ModelConfig(**{**BASE, "dim": 2, "n_heads": 1, "n_kv_heads": 1}, n_experts=2, top_k=1,
                      aux_loss_coef=0.0, router_z_loss_coef=0.5)
    router = _router(cfg, [[0.0, math.log(3)], [0.0, 0.0]])  # token 0 logits (0, 0), token 1 (ln 3, 0)
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    # logsumexp: ln 2 and ln 4 = 2 ln 2; mean of squares (1 + 4) / 2 * ln2^2
    assert router(x)[2].item() == pytest.approx(0.5 * 2.5 * math.log(2) ** 2, rel=1e-12)
    assert router(x, torch.tensor([True, False]))[2].item() == pytest.approx(0.5 * math.log(2) ** 2, rel=1e-12)
    router(x)[2].backward()
    # d/dlogits of 0.5 * mean lse^2 = 0.5 * lse * softmax: token 1 softmax (3/4, 1/4), lse 2 ln 2
    torch.testing.assert_close(router.gate.weight.grad[:, 1],
                               torch.tensor([0.5 * 2 * math.log(2) * 0.75, 0.5 * 2 * math.log(2) * 0.25],
                                            dtype=torch.float64), rtol=1e-12, atol=0)


def test_group_limited_routing_keeps_the_groups_with_the_largest_expert_score():
    scores = torch.tensor([[0.10, 0.50, 0.45, 0.44]])
    # groups {0, 1} (max 0.50, sum 0.60) and {2, 3} (max 0.45, sum 0.89): max keeps group 0
    assert sorted(choose_experts(scores, 2, n_groups=2, topk_groups=1)[0].tolist()) == [0, 1]
    assert sorted(choose_experts(scores, 2)[0].tolist()) == [1, 2]
    assert sorted(choose_experts(scores, 2, n_groups=2, topk_groups=2)[0].tolist()) == [1, 2]


def test_top2_sum_groups_choose_other_experts_than_max_groups():
    scores = torch.tensor([[0.10, 0.50, 0.45, 0.44]])
    # groups {0, 1} (top-2 sum 0.60) and {2, 3} (0.89): the sum keeps group 1 where the max keeps group 0
    assert choose_experts(scores, 2, n_groups=2, topk_groups=1, group_score="top2_sum")[0].tolist() == [2, 3]
    # four groups of two, two kept: max scores (0.9, 0.5, 0.6, 0.55) keep groups 0 and 2, top-2 sums
    # (0.9, 1.0, 1.05, 0.65) groups 2 and 1; then the best three experts of the kept groups
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.6, 0.45, 0.55, 0.1]])
    assert choose_experts(scores, 3, n_groups=4, topk_groups=2)[0].tolist() == [0, 4, 5]
    assert choose_experts(scores, 3, n_groups=4, topk_groups=2, group_score="top2_sum")[0].tolist() == [4, 2, 3]


def test_the_group_score_includes_the_bias():
    scores = torch.tensor([[0.10, 0.50, 0.45, 0.44]])
    # with the bias group 0 sums 0.55 + 0.50 = 1.05 > 0.89 (without it 0.60 < 0.89)
    bias = torch.tensor([0.45, 0.0, 0.0, 0.0])
    assert choose_experts(scores, 2, 2, 1, bias, group_score="top2_sum")[0].tolist() == [0, 1]


@pytest.mark.parametrize("normalize", [False, True])
def test_sigmoid_weights_are_renormalized_iff_asked_then_scaled(normalize):
    cfg = ModelConfig(**{**BASE, "dim": 2, "n_heads": 1, "n_kv_heads": 1}, n_experts=4, top_k=2,
                      router_score="sigmoid", norm_topk_prob=normalize, routed_scaling_factor=2.5)
    # logits (ln 3, 0, -ln 3, ln 1.5): sigmoids (3/4, 1/2, 1/4, 3/5); top-2: experts 0 and 3
    router = _router(cfg, [[math.log(3), 0.0], [0.0, 0.0], [-math.log(3), 0.0], [math.log(1.5), 0.0]])
    idx, weights, _ = router(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    assert idx.tolist() == [[0, 3]]
    expected = [0.75 / 1.35 * 2.5, 0.6 / 1.35 * 2.5] if normalize else [0.75 * 2.5, 0.6 * 2.5]
    torch.testing.assert_close(weights, torch.tensor([expected], dtype=torch.float64), rtol=1e-12, atol=0)


def test_a_sigmoid_record_from_before_the_scaling_factor_keeps_its_renormalization():
    from orangetron.model.config import model_from_record

    old = {"name": "old", "hidden_size": 16, "num_layers": 1, "num_heads": 4, "vocab_size": 32, "num_experts": 4,
           "top_k": 2, "moe_ffn_hidden_size": 8, "router_score": "sigmoid", "norm_topk_prob": False}
    assert model_from_record(old).norm_topk_prob
    assert not model_from_record({**old, "routed_scaling_factor": 1.0}).norm_topk_prob


def test_the_bias_chooses_the_experts_but_the_weights_stay_unbiased():
    cfg = ModelConfig(**{**BASE, "dim": 2, "n_heads": 1, "n_kv_heads": 1}, n_experts=2, top_k=1,
                      router_bias_rate=0.1)
    router = _router(cfg, [[0.0, 0.0], [math.log(3), 0.0]])  # logits (0, ln 3): scores (1/4, 3/4)
    router.expert_bias.copy_(torch.tensor([0.6, 0.0]))  # 0.85 > 0.75: expert 0 wins
    idx, weights, _ = router(torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64),
                             torch.tensor([True, False]))
    assert idx.tolist() == [[0], [0]]
    torch.testing.assert_close(weights, torch.tensor([[0.25], [0.25]], dtype=torch.float64), rtol=1e-12, atol=0)
    assert router.expert_load.tolist() == [1, 0]  # the padding token is routed but not counted


def test_bias_update_moves_towards_the_mean_load_and_restarts_the_count():
    cfg = ModelConfig(**BASE, n_experts=4, top_k=1, router_bias_rate=0.25)
    router = Router(cfg)
    router.expert_load = torch.tensor([3, 1, 0, 0])  # mean 1
    update_router_bias(router)
    assert router.expert_bias.tolist() == [-0.25, 0.0, 0.25, 0.25]
    assert router.expert_load.tolist() == [0, 0, 0, 0]


def test_router_option_rules():
    with pytest.raises(ConfigError, match=r"n_expert_groups=3: n_experts 4 is not divisible"):
        ModelConfig(**BASE, n_experts=4, n_expert_groups=3)
    with pytest.raises(ConfigError, match=r"topk_groups=3: must be in 1..n_expert_groups=2"):
        ModelConfig(**BASE, n_experts=4, n_expert_groups=2, topk_groups=3)
    with pytest.raises(ConfigError, match=r"top_k=3: must be at most topk_groups \* experts per group = 2"):
        ModelConfig(**BASE, n_experts=4, top_k=3, n_expert_groups=2, topk_groups=1)
    with pytest.raises(ConfigError, match=r"router_z_loss_coef=-0.1: must be non-negative"):
        ModelConfig(**BASE, n_experts=4, router_z_loss_coef=-0.1)
    with pytest.raises(ConfigError, match=r"router_bias_rate=-1: must be non-negative"):
        ModelConfig(**BASE, n_experts=4, router_bias_rate=-1)
    with pytest.raises(ConfigError, match=r"group_score='top2_sum': needs at least 2 experts per group; "
                                          r"n_experts 4 / n_expert_groups 4"):
        ModelConfig(**BASE, n_experts=4, top_k=1, n_expert_groups=4, topk_groups=1, group_score="top2_sum")
    with pytest.raises(ConfigError, match=r"group_score='sum': must be one of max, top2_sum"):
        ModelConfig(**BASE, n_experts=4, group_score="sum")
    with pytest.raises(ConfigError, match=r"shared_expert_gate=True: requires n_shared_experts > 0"):
        ModelConfig(**BASE, n_experts=4, shared_expert_gate=True)
    with pytest.raises(ConfigError, match=r"routed_scaling_factor=0: must be positive"):
        ModelConfig(**BASE, n_experts=4, routed_scaling_factor=0)


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases(world: int) -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts)) for m, layout, opts in CASES[world]]


@pytest.mark.parametrize("world", sorted(CASES))
def test_router_options_match_one_device_and_the_planner(world):
    results = run_distributed(run_cases, world, args=(world,))
    for i, (model_name, layout, options) in enumerate(CASES[world]):
        check_layout([r[i] for r in results], MODELS[model_name], layout, _config(options),
                     f"{model_name} {layout} {options}")


def test_the_trainer_moves_the_bias_and_a_resumed_run_restores_it(tmp_path):
    import dataclasses

    from orangetron.model import model_preset
    from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
    from orangetron.train.trainer import TrainConfig, train

    model = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0, router_bias_rate=0.01)
    base = dict(model=model, seq_len=32, batch_size=4, warmup=1, eval_batches=1, corpus_bytes=200_000)
    straight = train(TrainConfig(**base, steps=4, out=str(tmp_path / "straight"), save_every=4), progress=False)
    train(TrainConfig(**base, steps=4, stop_after=2, out=str(tmp_path / "split")), progress=False)
    saved = load_checkpoint(latest_checkpoint(tmp_path / "split" / "checkpoints"))["buffers"]
    assert len(saved) == 2 and any(bias.abs().max() > 0 for bias in saved.values())
    for bias in saved.values():  # each step moves each entry by -0.01, 0 or +0.01
        torch.testing.assert_close(bias, (bias / 0.01).round() * 0.01, rtol=0, atol=1e-6)
        assert bias.abs().max() <= 0.02 + 1e-6
    resumed = train(TrainConfig(**base, steps=4, out=str(tmp_path / "split"), resume=True, save_every=4),
                    progress=False)
    assert resumed["losses"] == straight["losses"]


def test_the_bias_moves_only_with_training_tokens_on_tp_with_sequence_parallelism(tmp_path):
    """Trainer level, evaluation after every step: tp2 x dp2 with sequence parallelism and ep2 (the routed
    tokens of a tp rank are its sequence shard, so the loads must be summed over tp as well as dp) against the
    one-device reference, whose hook counts training forwards only (tests/trainer_reference.py). An evaluation
    batch counted into the loads, or a load not summed over a dimension, moves some bias the other way."""
    import dataclasses

    from trainer_reference import assert_matches_reference, reference_training

    from orangetron.model import model_preset
    from orangetron.train.trainer import TrainConfig, train

    model = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0, router_bias_rate=0.05)
    cfg = TrainConfig(model=model, seq_len=16, batch_size=4, steps=3, warmup=0, eval_every=1, eval_batches=2,
                      corpus_bytes=60_000, param_dtype="float64", tp=2, dp=2, ep=2, sequence_parallel=True,
                      out=str(tmp_path / "run"), save_every=3)
    result = train(cfg, progress=False)
    reference = reference_training(dataclasses.replace(cfg, tp=1, dp=1, ep=1, sequence_parallel=False, out=None,
                                                         save_every=0))
    biases = [b for n, b in reference["buffers"].items() if n.endswith("expert_bias")]
    assert biases and all(b.abs().max() > 0 for b in biases)  # the rate moved every router's bias
    assert_matches_reference(result, tmp_path / "run", reference, rtol=1e-9)
