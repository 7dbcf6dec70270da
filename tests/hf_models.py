"""Tiny Hugging Face models built offline for the conversion tests, and transformers patched to float64.

Every parameter is drawn with a large spread (std 0.3; norm weights around 1), so that a wrong conversion
(a permuted head, a swapped projection, another epsilon) moves the logits far past float64 rounding.

transformers computes a few things in float32 even in a float64 model: RMSNorm (Qwen3's QK-norm is one too),
the rotary tables (their frequencies and angles) and the Mixtral router's softmax. `float64_islands()` replaces
those forwards with the same formulas in the model's dtype, so that the logits compare to 1e-10; the rotary
frequencies are HF's own functions evaluated with `torch.float` standing for float64.

Their configs' BOS and EOS ids are 0, the one special token of the tokenizer `add_tokenizer` trains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 320  # a byte-level BPE's 256 bytes, its special token and some merges fit
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def corpus_file(folder: Path, nbytes: int = 60_000) -> Path:
    """Some of the stdlib corpus as a text file (the tokenizers and the training runs read it)."""
    from orangetron.train.corpus import stdlib_corpus

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.txt"
    path.write_text(stdlib_corpus(nbytes), encoding="utf-8")
    return path


def add_tokenizer(folder: Path, vocab: int = 300) -> Path:
    """A byte-level BPE (`orangetron tokenizer train`) trained on the corpus, saved into the model folder."""
    from orangetron.train.prepare import train_tokenizer

    return train_tokenizer([str(corpus_file(folder.parent / f"{folder.name}-text"))], folder, vocab)


def _spread(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # about the scores' spread, so that it changes choices
                b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float64) * 0.1)


def llama(folder: Path, *, tied: bool = False, eps: float = 1e-3, seed: int = 0, **changes) -> Path:
    """A 2-layer Llama (GQA 4:2 heads of 16, llama3 rope scaling covering every band) saved in float64."""
    config = transformers.LlamaConfig(
        vocab_size=changes.pop("vocab_size", VOCAB), hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=eps,
        tie_word_embeddings=tied, rope_parameters=dict(LLAMA3_ROPE), initializer_range=0.3, bos_token_id=0,
        eos_token_id=0, **changes)
    return _save(transformers.LlamaForCausalLM, config, folder, seed)


def mistral(folder: Path, *, eps: float = 1e-3, seed: int = 2, **changes) -> Path:
    """A 2-layer Mistral with no sliding window (GQA 4:2 heads of 16), saved in float64."""
    shape = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    rope = {"rope_type": "default", "rope_theta": 700.0}
    config = transformers.MistralConfig(**shape, rms_norm_eps=eps, sliding_window=None, rope_parameters=rope,
                                        initializer_range=0.3, bos_token_id=0, eos_token_id=0, **changes)
    return _save(transformers.MistralForCausalLM, config, folder, seed)


def qwen2(folder: Path, *, tied: bool = False, eps: float = 1e-3, seed: int = 5, **changes) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, GQA 4:2 heads of 16) saved in float64."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=eps, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, initializer_range=0.3, bos_token_id=0,
        eos_token_id=0, **changes)
    return _save(transformers.Qwen2ForCausalLM, config, folder, seed)


def qwen3(folder: Path, *, tied: bool = False, eps: float = 1e-3, seed: int = 6, **changes) -> Path:
    """A 2-layer Qwen3 (QK-norm, GQA 4:2 heads of 32 over a width of 64) saved in float64."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=eps, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 2000.0}, initializer_range=0.3, bos_token_id=0,
        eos_token_id=0, **changes)
    return _save(transformers.Qwen3ForCausalLM, config, folder, seed)


def mixtral(folder: Path, *, eps: float = 1e-3, seed: int = 1, **changes) -> Path:
    """A 2-layer Mixtral (4 experts, top-2, GQA 4:2) saved in float64."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        rms_norm_eps=eps, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.3,
        bos_token_id=0, eos_token_id=0, **changes)
    return _save(transformers.MixtralForCausalLM, config, folder, seed)


def qwen2_moe(folder: Path, *, eps: float = 1e-3, seed: int = 4, **changes) -> Path:
    """A 2-layer Qwen2-MoE (4 experts, top-2 unnormalized, q/k/v biases, a gated shared expert two experts
    wide) saved in float64."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, max_position_embeddings=256, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.3, bos_token_id=0,
        eos_token_id=0, **changes)
    return _save(transformers.Qwen2MoeForCausalLM, config, folder, seed)


def qwen3_moe(folder: Path, *, eps: float = 1e-3, seed: int = 5, **changes) -> Path:
    """A 2-layer Qwen3-MoE (4 experts, top-2 renormalized, QK-norm, heads of 24 wider than hidden / heads)
    saved in float64."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.3, bos_token_id=0,
        eos_token_id=0, **changes)
    return _save(transformers.Qwen3MoeForCausalLM, config, folder, seed)


def dots1(folder: Path, *, eps: float = 1e-3, seed: int = 6, **changes) -> Path:
    """A 3-layer Dots1 (the first dense; 8 experts in 4 groups, 2 groups and top-3 per token, sigmoid scores
    with a correction bias, renormalized and scaled by 2.5, one shared expert, QK-norm) saved in float64. The
    correction bias is drawn too: zero would hide a bias left out."""
    config = transformers.Dots1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        moe_intermediate_size=24, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.3, bos_token_id=0,
        eos_token_id=0, **changes)
    return _save(transformers.Dots1ForCausalLM, config, folder, seed)


def _save(cls, config, folder: Path, seed: int, **save_options) -> Path:
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64)
    _spread(model, seed)
    model.save_pretrained(folder, **save_options)
    return folder


def reference(folder: Path):
    """transformers' own model of `folder` in float64: SDPA attention, eager experts, evaluation mode. Tensors
    a family keeps in float32 whatever the dtype (Dots1's router weight and correction bias) are set back to
    the checkpoint's float64 values, so that its float32 rounding does not stand in the way of 1e-10."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager").eval()
    kept = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype != torch.float64]
    if kept:
        from safetensors.torch import load_file

        saved = load_file(Path(folder) / "model.safetensors")
        for name in (n for n in kept if n in saved):  # not the rotary tables, which are computed
            owner, _, attr = name.rpartition(".")
            getattr(model.get_submodule(owner), attr).data = saved[name]
    return model


def _rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _softmax_router(self, hidden_states: torch.Tensor):
    """Mixtral's, Qwen2-MoE's and Qwen3-MoE's router in the model's dtype (Mixtral always renormalizes)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index


def _dots1_router(self, hidden_states: torch.Tensor):
    """Dots1's router in the model's dtype: the same steps as transformers' Dots1TopkRouter."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)  # float64 after `reference`
    scores = router_logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
    kept = torch.zeros_like(groups).scatter_(1, torch.topk(groups, k=self.topk_group, dim=-1)[1], 1).bool()
    choice = choice.masked_fill(~kept.repeat_interleave(self.num_experts // self.num_group, dim=1), float("-inf"))
    top_index = torch.topk(choice, k=self.top_k, dim=-1)[1]
    weights = scores.gather(1, top_index)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights * self.routed_scaling_factor, top_index


def _islands(model) -> dict[type, tuple[str, object]]:
    """The classes in `model` that compute in float32 whatever the model's dtype, with float64 forwards."""
    patches: dict[type, tuple[str, object]] = {}
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            patches[type(module)] = ("forward", _rms_norm)
        elif kind.endswith(("TopKRouter", "TopkRouter")):
            patches[type(module)] = ("forward", _dots1_router if kind.startswith("Dots1") else _softmax_router)
    return patches


@contextlib.contextmanager
def float64_islands(model) -> Iterator[None]:
    """Inside: `model`'s RMSNorms, rotary tables and routers compute in float64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.model.rotary_emb
    init = (type(rotary).compute_default_rope_parameters if rotary.rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rotary.rope_type])
    with mock.patch.object(torch, "float", torch.float64):  # HF's frequencies, evaluated in float64
        inv_freq, _ = init(model.config)
    saved = rotary.inv_freq
    rotary.inv_freq = inv_freq
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(type(rotary), "forward", _rotary))
            for cls, (name, forward) in _islands(model).items():
                stack.enter_context(mock.patch.object(cls, name, forward))
            yield
    finally:
        rotary.inv_freq = saved
