"""Tiny Hugging Face models built offline for the conversion tests, and transformers patched to float64.

Every parameter is drawn with a large spread (std 0.3; norm weights around 1), so that a wrong conversion
(a permuted head, a swapped projection, another epsilon) moves the logits far past float64 rounding.

transformers computes a few things in float32 even in a float64 model: RMSNorm (Qwen3's QK-norm is one too),
the rotary tables (their frequencies and angles) and the Mixtral router's softmax. `float64_islands()` replaces
those forwards with the same formulas in the model's dtype, so that the logits compare to 1e-10; the rotary
frequencies are HF's own functions evaluated with `torch.float` standing for float64.
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


def llama(folder: Path, *, tied: bool = False, eps: float = 1e-3, seed: int = 0, **changes) -> Path:
    """A 2-layer Llama (GQA 4:2 heads of 16, llama3 rope scaling covering every band) saved in float64."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=eps, tie_word_embeddings=tied,
        rope_parameters=dict(LLAMA3_ROPE), initializer_range=0.3, bos_token_id=1, eos_token_id=2, **changes)
    return _save(transformers.LlamaForCausalLM, config, folder, seed)


def qwen2(folder: Path, *, tied: bool = False, eps: float = 1e-3, seed: int = 5, **changes) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, GQA 4:2 heads of 16) saved in float64."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=eps, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, initializer_range=0.3, bos_token_id=1,
        eos_token_id=2, **changes)
    return _save(transformers.Qwen2ForCausalLM, config, folder, seed)


def qwen3(folder: Path, *, tied: bool = False, eps: float = 1e-3, seed: int = 6, **changes) -> Path:
    """A 2-layer Qwen3 (QK-norm, GQA 4:2 heads of 32 over a width of 64) saved in float64."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=eps, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 2000.0}, initializer_range=0.3, bos_token_id=1,
        eos_token_id=2, **changes)
    return _save(transformers.Qwen3ForCausalLM, config, folder, seed)


def mixtral(folder: Path, *, eps: float = 1e-3, seed: int = 1, **changes) -> Path:
    """A 2-layer Mixtral (4 experts, top-2, GQA 4:2) saved in float64."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        rms_norm_eps=eps, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, **changes)
    return _save(transformers.MixtralForCausalLM, config, folder, seed)


def _save(cls, config, folder: Path, seed: int, **save_options) -> Path:
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64)
    _spread(model, seed)
    model.save_pretrained(folder, **save_options)
    return folder


def reference(folder: Path):
    """transformers' own model of `folder` in float64: SDPA attention, eager experts, evaluation mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager").eval()


def _rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _mixtral_router(self, hidden_states: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
    return router_logits, top_value / top_value.sum(dim=-1, keepdim=True), top_index


@contextlib.contextmanager
def float64_islands(model) -> Iterator[None]:
    """Inside: `model`'s RMSNorms, rotary tables and Mixtral routers compute in float64."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    rotary = model.model.rotary_emb
    init = (type(rotary).compute_default_rope_parameters if rotary.rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rotary.rope_type])
    with mock.patch.object(torch, "float", torch.float64):  # HF's frequencies, evaluated in float64
        inv_freq, _ = init(model.config)
    saved = rotary.inv_freq
    rotary.inv_freq = inv_freq
    try:
        with mock.patch.object(modeling_llama.LlamaRMSNorm, "forward", _rms_norm), \
                mock.patch.object(modeling_mixtral.MixtralRMSNorm, "forward", _rms_norm), \
                mock.patch.object(modeling_qwen2.Qwen2RMSNorm, "forward", _rms_norm), \
                mock.patch.object(modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm), \
                mock.patch.object(type(rotary), "forward", _rotary), \
                mock.patch.object(modeling_mixtral.MixtralTopKRouter, "forward", _mixtral_router):
            yield
    finally:
        rotary.inv_freq = saved
