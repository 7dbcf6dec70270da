"""The planner's activation bytes equal what the reference model keeps for backward, to the byte.

`orangetron.memory.track_activations` measures the distinct storages autograd saves during a forward and
backward of `Transformer.loss`; `predicted_step(...)["activations"]` is `plan.activations`' term-by-term
count. The memory-lean autograd Functions that make the model keep only those terms are checked here too,
each against plain PyTorch (or `gradcheck`) in float64.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from orangetron import memory
from orangetron.model import ModelConfig, Transformer, attention_kernel, load_balancing_loss
from orangetron.model.autograd import (
    CPUFlashAttention,
    CrossEntropy,
    FromExpertOrder,
    LoadBalancingLoss,
    RMSNormFunction,
    RouterLogits,
    SwiGLUActivation,
    ToExpertOrder,
    TopKWeights,
)
from orangetron.parallel import ParallelConfig
from orangetron.plan.bridge import predicted_step
from orangetron.spec.layout import Layout

torch.set_num_threads(1)

BASE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48)
MODELS = {
    "dense-gqa": {},
    "dense-mha-tied": dict(n_kv_heads=4, tied_embeddings=True),
    "moe-gqa": dict(n_experts=4, top_k=2, moe_ffn_dim=24),
    "moe-shared-freq2-tied": dict(n_experts=4, top_k=2, moe_ffn_dim=16, n_shared_experts=1, moe_layer_freq=2,
                                  tied_embeddings=True),
    "moe-top1-mha": dict(n_layers=3, n_kv_heads=4, n_experts=3, top_k=1, moe_ffn_dim=16, n_shared_experts=2),
    "moe-sigmoid": dict(n_experts=4, top_k=2, moe_ffn_dim=24, router_score="sigmoid", norm_topk_prob=True),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SHAPES = [(2, 16), (1, 24)]  # (micro-batch, sequence)


def _measured_and_predicted(cfg, dtype, b, s, labels=None):
    model = Transformer(cfg, dtype=DTYPES[dtype])
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen)
    labels = batch[:, 1:] if labels is None else labels
    with memory.track_activations(model) as meter:
        model.loss(batch[:, :-1], labels).backward()  # tokens and labels: views of one batch tensor
    _, predicted = predicted_step(cfg, Layout(), ParallelConfig(param_dtype=dtype), seq_len=s, micro_batch=b)
    return meter.peak_bytes, predicted["activations"]


@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_planner_activation_bytes_equal_measured(name, dtype, b, s):
    cfg = ModelConfig(**{**BASE, **MODELS[name]})
    measured, predicted = _measured_and_predicted(cfg, dtype, b, s)
    assert measured == predicted


def test_leading_dense_layers_activation_bytes_equal_measured():
    cfg = dataclasses.replace(ModelConfig(**{**BASE, **MODELS["moe-gqa"], "n_layers": 3}), first_dense_layers=1)
    measured, predicted = _measured_and_predicted(cfg, "float32", 2, 16)
    assert measured == predicted


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ["dense-gqa", "moe-gqa"])
def test_qkv_bias_qk_norm_and_a_free_head_dim_activation_bytes_equal_measured(name, dtype):
    """Qwen2/Qwen3 attention: biases keep nothing, QK-norm keeps Q and K before it; heads of 16 != 32 / 4."""
    cfg = ModelConfig(**{**BASE, **MODELS[name]}).with_changes(head_dim=16, qkv_bias=True, qk_norm=True)
    measured, predicted = _measured_and_predicted(cfg, dtype, 2, 16)
    assert measured == predicted


def test_padding_changes_no_activation_bytes():
    cfg = ModelConfig(**{**BASE, **MODELS["moe-gqa"]})
    labels = torch.full((2, 16), -100)
    labels[:, :5] = 3
    measured, predicted = _measured_and_predicted(cfg, "float32", 2, 16, labels)
    assert measured == predicted


# ---- the memory-lean Functions, each against plain PyTorch in float64 ---------------------------------
def _rand(*shape, seed=0, grad=True):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return t.requires_grad_(grad)


def _assert_same_output_and_grads(fn, reference, inputs, atol=1e-12):
    out, ref = fn(*inputs), reference(*inputs)
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    d_out = _rand(*out.shape, seed=99, grad=False)
    leaves = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    grads = torch.autograd.grad((out * d_out).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * d_out).sum(), leaves)
    for g, g_ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=atol)


def test_rmsnorm_function_matches_plain_pytorch_and_gradcheck():
    x, w = _rand(2, 3, 8), _rand(8, seed=1)

    def plain(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    _assert_same_output_and_grads(lambda x, w: RMSNormFunction.apply(x, w, 1e-5), plain, (x, w))
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-5), (x, w))


def test_rmsnorm_function_bfloat16_smoke():
    x, w = _rand(4, 16).bfloat16(), _rand(16, seed=1).bfloat16()
    y = RMSNormFunction.apply(x, w, 1e-5)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * w
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_activation_matches_plain_pytorch_and_gradcheck(weighted):
    gate, up = _rand(5, 6), _rand(5, 6, seed=1)
    weight = _rand(5, seed=2) if weighted else None

    def plain(gate, up, weight):
        h = F.silu(gate) * up
        return h if weight is None else h * weight.unsqueeze(-1)

    _assert_same_output_and_grads(SwiGLUActivation.apply, plain, (gate, up, weight))
    assert torch.autograd.gradcheck(SwiGLUActivation.apply, (gate, up, weight))


@pytest.mark.parametrize("causal,hq,hk", [(True, 4, 2), (True, 4, 4), (False, 6, 2)])
def test_cpu_flash_attention_matches_reference_and_gradcheck(causal, hq, hk):
    q, k, v = _rand(2, 5, hq, 4), _rand(2, 5, hk, 4, seed=1), _rand(2, 5, hk, 4, seed=2)

    def flash(q, k, v):
        return CPUFlashAttention.apply(q, k, v, causal, 0.4)[0]

    def reference(q, k, v):
        return attention_kernel(q, k, v, causal=causal, scale=0.4, impl="reference")[0]

    _assert_same_output_and_grads(flash, reference, (q, k, v), atol=1e-10)
    assert torch.autograd.gradcheck(flash, (q, k, v))


def test_cpu_flash_attention_keeps_kv_unexpanded():
    q, k, v = _rand(1, 6, 4, 8), _rand(1, 6, 1, 8, seed=1), _rand(1, 6, 1, 8, seed=2)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        CPUFlashAttention.apply(q, k, v, True, 0.5)
    assert shapes == [(1, 6, 4, 8), (1, 6, 1, 8), (1, 6, 1, 8), (1, 6, 4, 8), (1, 4, 6)]  # q, k, v, out, lse


def _topk_idx(t, k, n_experts, seed=3):
    scores = torch.rand(t, n_experts, generator=torch.Generator().manual_seed(seed))
    return scores.topk(k, dim=-1).indices


def test_expert_order_gather_and_combine_match_plain_indexing_and_gradcheck():
    t, k, dim = 5, 2, 3
    idx = _topk_idx(t, k, 4)
    order = torch.argsort(idx.reshape(-1), stable=True)
    x, w, y_sorted = _rand(t, dim), _rand(t * k, seed=1), _rand(t * k, dim, seed=2)
    _assert_same_output_and_grads(lambda x: ToExpertOrder.apply(x, idx, k), lambda x: x[order // k], (x,))
    _assert_same_output_and_grads(lambda w: ToExpertOrder.apply(w, idx, 1), lambda w: w[order], (w,))
    inverse = torch.argsort(order)
    _assert_same_output_and_grads(lambda y: FromExpertOrder.apply(y, idx),
                                  lambda y: y[inverse].view(t, k, dim).sum(1), (y_sorted,))
    assert torch.autograd.gradcheck(lambda x: ToExpertOrder.apply(x, idx, k), (x,))
    assert torch.autograd.gradcheck(lambda y: FromExpertOrder.apply(y, idx), (y_sorted,))


def test_router_logits_match_plain_linear_and_gradcheck():
    x, weight = _rand(5, 6), _rand(3, 6, seed=1)
    _assert_same_output_and_grads(RouterLogits.apply, F.linear, (x, weight))
    assert torch.autograd.gradcheck(RouterLogits.apply, (x, weight))
    logits = RouterLogits.apply(x.detach().bfloat16(), weight.detach().bfloat16())
    assert logits.dtype == torch.float32  # 16-bit inputs, float32 logits


@pytest.mark.parametrize("normalize", [False, True])
def test_topk_weights_match_plain_pytorch_and_gradcheck(normalize):
    scores = _rand(6, 4).sigmoid().detach().requires_grad_()
    idx = scores.detach().topk(2, dim=-1).indices

    def plain(scores):
        weights = scores.topk(2, dim=-1).values
        return weights / weights.sum(-1, keepdim=True) if normalize else weights

    _assert_same_output_and_grads(lambda s: TopKWeights.apply(s, idx, normalize), plain, (scores,))
    assert torch.autograd.gradcheck(lambda s: TopKWeights.apply(s, idx, normalize), (scores,))


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_function_matches_plain_pytorch_and_gradcheck(masked):
    scores = _rand(6, 4).softmax(-1).detach().requires_grad_()
    idx = _topk_idx(6, 2, 4)
    mask = torch.tensor([True, False, True, True, False, True]) if masked else None

    def plain(scores):
        return load_balancing_loss(scores if mask is None else scores[mask], idx if mask is None else idx[mask], 4)

    _assert_same_output_and_grads(lambda s: LoadBalancingLoss.apply(s, idx, mask), plain, (scores,))
    assert torch.autograd.gradcheck(lambda s: LoadBalancingLoss.apply(s, idx, mask), (scores,))


def test_cross_entropy_function_matches_plain_pytorch_and_gradcheck():
    logits, labels = _rand(6, 5), torch.tensor([0, 4, -100, 2, 2, -100])

    def plain(logits):
        return F.cross_entropy(logits, labels, ignore_index=-100)

    _assert_same_output_and_grads(lambda x: CrossEntropy.apply(x, labels, -100), plain, (logits,))
    assert torch.autograd.gradcheck(lambda x: CrossEntropy.apply(x, labels, -100), (logits,))
    all_ignored = CrossEntropy.apply(logits, torch.full((6,), -100), -100)
    assert all_ignored.item() == 0.0
