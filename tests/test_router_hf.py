"""The router against transformers' own: DeepSeek-V3 / Dots1 top-k routers (sigmoid scores, correction bias,
groups scored by their top-2 sum, renormalization by `norm_topk_prob`, `routed_scaling_factor`).

HF's routers compute in float32 whatever the model dtype, so both run in float32 here: the same experts, and
weights within float32 rounding.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402
from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter  # noqa: E402

from orangetron.model import ModelConfig  # noqa: E402
from orangetron.model.moe import Router  # noqa: E402

HF_ROUTERS = {"dots1": Dots1TopkRouter, "deepseek_v3": DeepseekV3TopkRouter}


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("family", sorted(HF_ROUTERS))
def test_sigmoid_group_router_equals_transformers(family, normalize):
    dim, experts, top_k, groups, per_token, scale = 16, 16, 4, 4, 2, 2.5
    hf_config = SimpleNamespace(num_experts_per_tok=top_k, num_local_experts=experts, hidden_size=dim,
                                routed_scaling_factor=scale, n_group=groups, topk_group=per_token,
                                norm_topk_prob=normalize)
    theirs = HF_ROUTERS[family](hf_config)
    ours = Router(ModelConfig(dim=dim, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=8, ffn_dim=8,
                              n_experts=experts, top_k=top_k, moe_ffn_dim=8, router_score="sigmoid",
                              norm_topk_prob=normalize, routed_scaling_factor=scale, n_expert_groups=groups,
                              topk_groups=per_token, group_score="top2_sum", router_bias_rate=0.01))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(experts, dim, generator=gen) * 0.3)
        theirs.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.2)
        ours.gate.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, dim, generator=gen)
    _, their_weights, their_idx = theirs(x)
    our_idx, our_weights, _ = ours(x)
    # HF leaves its top-k unsorted: compare each token's (expert, weight) pairs in expert order.
    their_order, our_order = their_idx.argsort(-1), our_idx.argsort(-1)
    assert torch.equal(their_idx.gather(-1, their_order), our_idx.gather(-1, our_order))
    torch.testing.assert_close(our_weights.gather(-1, our_order), their_weights.gather(-1, their_order),
                               rtol=1e-6, atol=0)
