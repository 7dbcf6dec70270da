"""The single-device reference model: attention kernels, config, rope, MoE, and the transformer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from orangetron.model import (
    ConfigError,
    ModelConfig,
    MoE,
    Router,
    Transformer,
    apply_rope,
    attention_kernel,
    init_parameter,
    model_preset,
    rope_cos_sin,
)
from orangetron.spec.model import ModelSpec

torch.set_num_threads(1)

TINY = model_preset("tiny")
TINY_MOE = model_preset("tiny-moe")


def _qkv(b, sq, sk, hq, hk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(b, sk, hk, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(b, sk, hk, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def _out_lse_grads(q, k, v, impl, causal, scale=None):
    out, lse = attention_kernel(q, k, v, causal=causal, scale=scale, impl=impl)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(out.dtype))
    return out, lse, grads


# --- attention kernels -----------------------------------------------------------------------------------

ATTN_CASES = [  # causal, Sq, Sk, Hq, Hk
    (True, 6, 6, 4, 4),
    (True, 7, 7, 4, 2),
    (False, 5, 9, 4, 2),
    (False, 8, 3, 2, 2),
]


@pytest.mark.parametrize("causal,sq,sk,hq,hk", ATTN_CASES)
def test_attention_fused_matches_reference_float64(causal, sq, sk, hq, hk):
    q, k, v = _qkv(2, sq, sk, hq, hk, 8, torch.float64)
    out_f, lse_f, grads_f = _out_lse_grads(q, k, v, "fused", causal, scale=0.3)
    out_r, lse_r, grads_r = _out_lse_grads(q, k, v, "reference", causal, scale=0.3)
    assert out_f.shape == (2, sq, hq, 8) and lse_f.shape == (2, hq, sq)
    assert out_f.dtype == lse_f.dtype == lse_r.dtype == torch.float64
    torch.testing.assert_close(out_f, out_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse_f, lse_r, rtol=0, atol=1e-10)
    for g_f, g_r in zip(grads_f, grads_r, strict=True):
        torch.testing.assert_close(g_f, g_r, rtol=0, atol=1e-10)


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("causal,sq,sk,hq,hk", ATTN_CASES)
def test_attention_lse_and_out_match_explicit_scores(impl, causal, sq, sk, hq, hk):
    q, k, v = _qkv(1, sq, sk, hq, hk, 4, torch.float64, seed=3)
    out, lse = attention_kernel(q, k, v, causal=causal, impl=impl)
    for h in range(hq):
        g = h // (hq // hk)  # the kv head this query head reads
        scores = q[0, :, h] @ k[0, :, g].T / math.sqrt(4)  # [Sq, Sk]
        if causal:
            scores = scores.masked_fill(torch.ones(sq, sk).triu(1).bool(), float("-inf"))
        torch.testing.assert_close(lse[0, h], torch.logsumexp(scores, -1), rtol=0, atol=1e-12)
        torch.testing.assert_close(out[0, :, h], scores.softmax(-1) @ v[0, :, g], rtol=0, atol=1e-12)


def test_attention_lse_gradient_only_on_reference_path():
    q, k, v = _qkv(1, 4, 4, 2, 1, 4, torch.float64)
    assert not attention_kernel(q, k, v, causal=True, impl="fused")[1].requires_grad
    assert attention_kernel(q, k, v, causal=True, impl="reference")[1].requires_grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_low_precision_smoke(dtype, tol):
    q, k, v = _qkv(2, 16, 16, 4, 2, 16, dtype)
    out_f, lse_f, grads_f = _out_lse_grads(q, k, v, "fused", True)
    out_r, lse_r, grads_r = _out_lse_grads(q, k, v, "reference", True)
    assert out_f.dtype == out_r.dtype == dtype
    assert lse_f.dtype == lse_r.dtype == torch.float32
    torch.testing.assert_close(out_f, out_r, rtol=tol, atol=tol)
    torch.testing.assert_close(lse_f, lse_r, rtol=tol, atol=tol)
    for g_f, g_r in zip(grads_f, grads_r, strict=True):
        torch.testing.assert_close(g_f, g_r, rtol=5 * tol, atol=5 * tol)


@pytest.mark.parametrize(
    "shapes,causal,impl,match",
    [
        (((1, 4, 2, 8), (1, 5, 2, 8)), True, "fused", "Sq == Sk"),
        (((1, 4, 3, 8), (1, 4, 2, 8)), False, "fused", "not divisible"),
        (((1, 4, 2, 8), (1, 4, 2, 4)), False, "fused", "head_dim"),
        (((4, 2, 8), (1, 4, 2, 8)), False, "fused", "4-D"),
        (((1, 4, 2, 8), (1, 4, 2, 8)), False, "magic", "impl='magic'"),
    ],
)
def test_attention_rejects_bad_input(shapes, causal, impl, match):
    q, k = torch.zeros(shapes[0]), torch.zeros(shapes[1])
    with pytest.raises(ValueError, match=match):
        attention_kernel(q, k, k, causal=causal, impl=impl)


# --- config ----------------------------------------------------------------------------------------------

BASE = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=256)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(dim=0), "dim=0"),
        (dict(vocab_size=-1), "vocab_size=-1"),
        (dict(n_experts=-2), "n_experts=-2"),
        (dict(n_heads=6), "n_heads=6: dim 128 is not divisible by n_heads"),
        (dict(n_kv_heads=3), "n_kv_heads=3"),
        (dict(n_experts=4, top_k=5), "top_k=5"),
        (dict(dim=12, n_heads=4, n_kv_heads=4), "head_dim=3: must be even"),
        (dict(router_score="relu"), "router_score='relu'"),
        (dict(n_shared_experts=1), "n_shared_experts=1"),
    ],
)
def test_config_rejects_each_rule_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**BASE, **overrides})
    assert str(info.value).startswith(field)
    assert isinstance(info.value, ValueError)


def test_config_defaults_and_presets():
    cfg = ModelConfig(**BASE, n_experts=4, moe_layer_freq=2)
    assert cfg.moe_ffn_dim == cfg.ffn_dim and cfg.head_dim == 32
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert not TINY.is_moe_layer(0)
    assert 100_000 <= Transformer(TINY).num_parameters() <= 300_000
    assert TINY_MOE.n_experts == 4 and TINY_MOE.top_k == 2 and TINY_MOE.n_shared_experts == 1
    with pytest.raises(ConfigError, match="tiny-moe"):
        model_preset("huge")


# --- rotary embedding ------------------------------------------------------------------------------------

def test_rope_preserves_norms():
    x = torch.randn(2, 10, 3, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(10), 8, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


def test_rope_with_position_subset_equals_slice_of_full_sequence():
    x = torch.randn(2, 12, 3, 8, dtype=torch.float64)
    full = apply_rope(x, *rope_cos_sin(torch.arange(12), 8, 500.0, torch.float64))
    pos = torch.tensor([0, 1, 10, 11, 5, 3])  # head-tail chunks, then an arbitrary order
    part = apply_rope(x[:, pos], *rope_cos_sin(pos, 8, 500.0, torch.float64))
    torch.testing.assert_close(part, full[:, pos], rtol=0, atol=0)
    batched = apply_rope(x[:, pos], *rope_cos_sin(pos.expand(2, -1), 8, 500.0, torch.float64))
    torch.testing.assert_close(batched, part, rtol=0, atol=0)


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(i, j):
        qi = apply_rope(q, *rope_cos_sin(torch.tensor([i]), 8, 10000.0, torch.float64))
        kj = apply_rope(k, *rope_cos_sin(torch.tensor([j]), 8, 10000.0, torch.float64))
        return (qi * kj).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100))


def test_rope_rotation_direction_by_hand():
    """Llama's rotate-half convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), pairing i with i + D/2.

    Norms and relative positions cannot tell a rotation from its inverse; these hand-computed numbers can.
    head_dim 4, theta 100: the frequencies are 1 and 100^-1/2 = 0.1, so position 1 turns by 1 and 0.1 rad.
    """
    cos, sin = rope_cos_sin(torch.tensor([1]), 4, 100.0, torch.float64)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64).view(1, 1, 2, 4)
    expected = torch.tensor([[0.5403023058681398, 0.0, 0.8414709848078965, 0.0],  # cos 1, sin 1
                             [0.0, 0.9950041652780258, 0.0, 0.09983341664682815]],  # cos 0.1, sin 0.1
                            dtype=torch.float64).view(1, 1, 2, 4)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, rtol=0, atol=1e-15)


# --- mixture of experts ----------------------------------------------------------------------------------

def _naive_moe(moe: MoE, x: torch.Tensor, cfg: ModelSpec) -> torch.Tensor:
    """Per token: sum_j w_j * expert_{idx_j}(x) + gate(x) * shared(x), one token at a time."""
    ex, outs = moe.experts, []
    for x_t in x.reshape(-1, x.shape[-1]):
        logits = moe.router.gate.weight @ x_t
        scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
        weights, idx = scores.topk(cfg.top_k)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum()
        pairs = zip(weights * cfg.routed_scaling_factor, idx, strict=True)
        y = sum(w * (F.silu(x_t @ ex.w1[e]) * (x_t @ ex.w3[e])) @ ex.w2[e] for w, e in pairs)
        if moe.shared_expert is not None:
            se = moe.shared_expert
            shared = se.w2.weight @ (F.silu(se.w1.weight @ x_t) * (se.w3.weight @ x_t))
            if cfg.shared_expert_gate:
                shared = shared / (1 + torch.exp(-moe.shared_expert_gate.weight[0] @ x_t))
            y = y + shared
        outs.append(y)
    return torch.stack(outs).view_as(x)


MOE_ROUTERS = {
    "softmax": dict(router_score="softmax"),
    "sigmoid": dict(router_score="sigmoid", norm_topk_prob=True),
    # Dots1 without renormalization, with Qwen2-MoE's gated shared expert.
    "sigmoid-scaled-gated": dict(router_score="sigmoid", routed_scaling_factor=2.5, num_shared_experts=1,
                                 shared_expert_gate=True),
    "softmax-normalized-scaled": dict(router_score="softmax", norm_topk_prob=True, routed_scaling_factor=0.5),
}


@pytest.mark.parametrize("router", sorted(MOE_ROUTERS))
def test_moe_matches_naive_per_token_loop_with_all_gradients(router):
    torch.manual_seed(0)
    cfg = TINY_MOE.with_changes(hidden_size=16, moe_ffn_hidden_size=8, **MOE_ROUTERS[router])
    moe = MoE(cfg).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    d_y = torch.randn(2, 5, 16, dtype=torch.float64)
    params = [x, *moe.parameters()]

    grads = torch.autograd.grad((moe(x) * d_y).sum(), params)
    naive_grads = torch.autograd.grad((_naive_moe(moe, x, cfg) * d_y).sum(), params)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, cfg), rtol=0, atol=1e-12)
    for g, g_naive in zip(grads, naive_grads, strict=True):
        torch.testing.assert_close(g, g_naive, rtol=0, atol=1e-12)


def test_router_aux_loss_hand_computed():
    # Gate = identity on the first 3 dims, so the softmax scores are [4, 2, 1]/7 and [1, 2, 4]/7.
    cfg = ModelConfig(dim=4, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=8, ffn_dim=4, n_experts=3,
                      top_k=2, aux_loss_coef=0.1)
    router = Router(cfg).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(3, 4))
    x = torch.tensor([[math.log(4), math.log(2), 0, 0], [0, math.log(2), math.log(4), 0]], dtype=torch.float64)
    idx, weights, aux = router(x)
    assert [set(row) for row in idx.tolist()] == [{0, 1}, {1, 2}]
    torch.testing.assert_close(weights, torch.tensor([[4, 2], [4, 2]], dtype=torch.float64) / 7)
    # f = [1, 2, 1] / 4 assignments, P = [5, 4, 5] / 14 mean scores.
    expected = 0.1 * 3 * (0.25 * 5 / 14 + 0.5 * 4 / 14 + 0.25 * 5 / 14)
    torch.testing.assert_close(aux, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)


def test_sigmoid_router_weights_sum_to_one_in_float32():
    router = Router(dataclasses.replace(TINY_MOE, router_score="sigmoid", norm_topk_prob=True)).to(torch.bfloat16)
    idx, weights, aux = router(torch.randn(10, TINY_MOE.dim, dtype=torch.bfloat16))
    assert idx.dtype == torch.int64 and idx.shape == (10, 2)
    assert weights.dtype == aux.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))


def test_moe_bfloat16_smoke():
    moe = MoE(TINY_MOE).to(torch.bfloat16)
    x = torch.randn(2, 6, TINY_MOE.dim, dtype=torch.bfloat16, requires_grad=True)
    y = moe(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


# --- transformer -----------------------------------------------------------------------------------------

def _tokens(b, s, seed=0, vocab=256):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_transformer_logits_shape_and_aux(cfg):
    model = Transformer(cfg)
    logits = model(_tokens(2, 9))
    assert logits.shape == (2, 9, cfg.vocab_size) and logits.dtype == torch.float32
    assert model.aux_loss().dim() == 0
    assert (model.aux_loss() > 0) == (cfg.n_experts > 0)


def test_transformer_loss_decreases_with_sgd():
    model = Transformer(TINY_MOE, seed=1)
    tokens = _tokens(4, 16)
    losses = []
    for _ in range(6):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        model.zero_grad()
        loss.backward()
        with torch.no_grad():  # plain SGD; torch.optim's first step costs seconds of imports
            for p in model.parameters():
                p -= 0.5 * p.grad
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_fused_and_reference_kernels_agree_in_model_float64():
    model = Transformer(TINY_MOE, dtype=torch.float64)
    tokens = _tokens(2, 12)
    fused = model.loss(tokens, tokens)
    for layer in model.layers:
        layer.attention.kernel_impl = "reference"
    torch.testing.assert_close(model.loss(tokens, tokens), fused, rtol=1e-12, atol=0)


def test_init_is_deterministic_per_seed():
    a, b, c = Transformer(TINY_MOE, seed=3), Transformer(TINY_MOE, seed=3), Transformer(TINY_MOE, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    Transformer(TINY_MOE)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_init_depends_only_on_name_seed_and_config():
    model = Transformer(TINY_MOE, seed=5, dtype=torch.float64)
    for name, p in model.named_parameters():
        assert torch.equal(p, init_parameter(name, p.shape, TINY_MOE, 5).double()), name
    # A model with different modules still gives shared names the same values.
    deeper = Transformer(dataclasses.replace(TINY_MOE, num_layers=3, moe_layer_freq=2), seed=5)
    assert torch.equal(deeper.tok_embeddings.weight, model.tok_embeddings.weight.float())
    assert torch.equal(deeper.layers[1].attention.wq.weight, model.layers[1].attention.wq.weight.float())
    # Residual output projections use init_std / sqrt(2 * n_layers).
    wo = init_parameter("layers.0.attention.wo.weight", (256, 256), TINY_MOE, 0)
    assert abs(wo.std().item() - 0.02 / 2) < 1e-3


def test_tied_embeddings_use_one_matrix():
    cfg = dataclasses.replace(TINY, tied_embeddings=True)
    tied, untied = Transformer(cfg), Transformer(TINY)
    assert tied.output is None
    assert tied.num_parameters() == untied.num_parameters() - TINY.vocab_size * TINY.dim
    tokens = torch.full((1, 8), 3)  # only token 3 is embedded; other rows learn through the output role
    tied.loss(tokens, tokens).backward()
    assert tied.tok_embeddings.weight.grad[7].abs().sum() > 0


@pytest.mark.parametrize("cfg", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_ignored_padding_labels_do_not_change_loss(cfg):
    # For MoE this includes the load-balancing loss: padded positions are routed but not balanced.
    model = Transformer(cfg, dtype=torch.float64)
    tokens, labels = _tokens(2, 10), _tokens(2, 10, seed=1)
    padded_tokens = torch.cat([tokens, torch.zeros(2, 6, dtype=torch.long)], dim=1)
    padded_labels = torch.cat([labels, torch.full((2, 6), -100)], dim=1)
    torch.testing.assert_close(model.loss(padded_tokens, padded_labels), model.loss(tokens, labels),
                               rtol=1e-13, atol=0)
    all_ignored = model.loss(tokens, torch.full((2, 10), -100))
    assert torch.isfinite(all_ignored) and all_ignored.item() == 0.0


def test_explicit_position_ids_match_default():
    model = Transformer(TINY, dtype=torch.float64)
    tokens = _tokens(1, 8)
    torch.testing.assert_close(model(tokens, torch.arange(8)), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, TINY.max_seq_len + 1))
