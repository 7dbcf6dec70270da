"""A Hugging Face `config.json` <-> the one model schema, `ModelSpec`: no torch, no second mapping type.

`spec_from_hf` reads a config of a family orangetron builds (Llama, Mistral without a window, Qwen2, Qwen3,
Mixtral, Qwen2-MoE, Qwen3-MoE, Dots1) into a `ModelSpec`, accepting
transformers 5's spellings and the older ones (`rope_parameters` or `rope_scaling` + `rope_theta`,
`num_local_experts` or `num_experts`); a key the file leaves out means what the family's HF class defaults
it to. Every key is accounted for: mapped onto a field, checked to hold the one value orangetron honours, or
known to leave the model alone (metadata, generation defaults, token ids). Anything else is refused in one
line naming it (`HFConfigError`), never approximated: an active sliding window, an output-projection bias, latent
attention, another rope scaling, another family. Qwen2 always carries q/k/v biases (`qkv_bias`), Qwen3 always a
per-head QK-norm (`qk_norm`) and its own `head_dim`. `hf_config_of` writes a spec back as a config transformers
loads (`architectures` included). docs/models.md lists what maps where.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orangetron.spec.model import ModelSpec
from orangetron.spec.model_rules import ConfigError
from orangetron.spec.toml_values import check_scalar

CONFIG_FILE = "config.json"


class HFConfigError(ConfigError):
    """A Hugging Face config orangetron cannot honour; the message names the key."""


# What each family's HF config class defaults a missing key to (transformers' LlamaConfig, MixtralConfig, ...).
_QWEN = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02, "use_sliding_window": False,
         "sliding_window": 4096, "max_window_layers": 28}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "initializer_range": 0.02},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "initializer_range": 0.02,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                "initializer_range": 0.02, "sliding_window": 4096},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128},
    "qwen2_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "initializer_range": 0.02, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                  "norm_topk_prob": False, "qkv_bias": True},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
                  "initializer_range": 0.02, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "decoder_sparse_step": 1, "norm_topk_prob": False},
    "dots1": {"vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "num_hidden_layers": 62,
              "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
              "n_routed_experts": None, "n_shared_experts": None, "num_experts_per_tok": None,
              "moe_intermediate_size": 1408, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
              "norm_topk_prob": False, "routed_scaling_factor": 1.0, "max_window_layers": 62},
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "dots1": "Dots1ForCausalLM"}
_LATER = ("deepseek_v3", "deepseek_v2", "gemma")
# Keys a family's config reads beside the common ones (its defaults' keys are read too).
_FAMILY_KEYS = {
    "llama": set(), "mistral": set(), "mixtral": {"num_experts", "router_aux_loss_coef"}, "qwen2": set(),
    "qwen3": set(),
    "qwen2_moe": {"num_local_experts", "mlp_only_layers", "router_aux_loss_coef", "max_window_layers"},
    "qwen3_moe": {"num_local_experts", "mlp_only_layers", "router_aux_loss_coef", "head_dim"},
    "dots1": {"num_local_experts"},
}
# Structure that comes with a dense family: Qwen2's q/k/v biases, Qwen3's QK-norm (ModelSpec fields).
_DENSE_ATTENTION = {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}
# Families whose attention normalizes each query and key head (QK-norm) always.
_QK_NORM_FAMILIES = ("qwen3_moe", "dots1")
# The balancing-bias update speed a Dots1 import trains with: its config holds the bias, not how it moves;
# DeepSeek-V3's report (arXiv:2412.19437, section 4.2) moves it by 0.001 per step.
DOTS1_BIAS_RATE = 1e-3

# Keys that say nothing about the network's function: where it came from, token ids, inference and
# generation defaults, and the generic fields older transformers wrote into every config.
_NEUTRAL = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "is_decoder", "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "prefix",
    "task_specific_params", "finetuning_task", "tokenizer_class", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "pretraining_tp", "initializer_range",
})
# Keys that must hold the one value orangetron builds; the reason names what another value would be.
_REQUIRED: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "the runtime's MLPs are SwiGLU (silu gate)"),
    "attention_bias": (False, "it puts a bias on the output projection too, which is not built (Qwen2's q/k/v "
                              "biases come with its model_type)"),
    "mlp_bias": (False, "MLP biases are not built"),
    "attention_dropout": (0.0, "the runtime has no attention dropout"),
    "router_jitter_noise": (0.0, "the runtime's router has no jitter noise"),
    "output_router_logits": (False, "HF's balancing loss averages the expert loads over all layers before "
                                    "the product; the runtime's is a sum of per-layer losses"),
    "use_qk_norm": (False, "this family has no QK-norm (Qwen3's comes with its model_type)"),
    "qk_layernorm": (False, "this family has no QK-norm (Qwen3's comes with its model_type)"),
    "partial_rotary_factor": (1.0, "the runtime rotates whole heads"),
    "use_sliding_window": (False, "an active sliding window is not built"),
}
# Multi-head latent attention and other structure no family here has.
_REFUSED = {"q_lora_rank": "multi-head latent attention (MLA)", "kv_lora_rank": "multi-head latent attention (MLA)",
            "qkv_bias": "not a key of this family (Qwen2's q/k/v biases come with its model_type)",
            "quantization_config": "quantized weights are not read", "auto_map": "custom modelling code is not run"}


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face folder (or the file itself); ValueError naming the path."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}; not a Hugging Face model folder")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not a JSON file ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: holds a {type(config).__name__}, not a config object")
    return config


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def family_of(config: dict[str, Any]) -> str:
    """The config's family (a key of `ARCHITECTURES`); HFConfigError naming `model_type` for any other."""
    family = config.get("model_type")
    if family not in _DEFAULTS:
        later = " (planned: other families are being added)" if family in _LATER else ""
        raise HFConfigError(f"model_type={family!r}: orangetron reads {', '.join(_DEFAULTS)} configs{later}")
    expected = ARCHITECTURES[family]
    architectures = config.get("architectures") or [expected]
    if architectures != [expected]:
        raise HFConfigError(f"architectures={architectures!r}: a {family} config reads as [{expected!r}] only")
    return family


def spec_from_hf(config: dict[str, Any], name: str = "hf") -> ModelSpec:
    """The `ModelSpec` of a Hugging Face config (a parsed config.json); HFConfigError names the first key it
    cannot honour. The spec's `aux_loss_coef` is 0 (HF trains these families without the balancing loss
    unless `output_router_logits`, which is refused)."""
    family = family_of(config)
    _check_kinds(config)
    _check_keys(config, family)
    given = {**_DEFAULTS[family], **{k: v for k, v in config.items() if v is not None}}
    heads = given["num_attention_heads"]
    fields: dict[str, Any] = {
        "name": name, "hidden_size": given["hidden_size"], "num_layers": given["num_hidden_layers"],
        "num_heads": heads, "num_kv_heads": given["num_key_value_heads"] or heads,
        "vocab_size": given["vocab_size"], "head_dim": given.get("head_dim") or 0,
        "norm_eps": float(given["rms_norm_eps"]), "max_seq_len": given["max_position_embeddings"],
        "tied_embeddings": bool(given["tie_word_embeddings"]), "init_std": float(given["initializer_range"]),
        **_rope_fields(config, family),
    }
    if family == "mixtral":  # transformers 5 reads `num_experts` as `num_local_experts`
        experts = config.get("num_local_experts") or config.get("num_experts") or given["num_local_experts"]
        fields |= {"num_experts": experts, "top_k": given["num_experts_per_tok"],
                   "moe_ffn_hidden_size": given["intermediate_size"], "router_score": "softmax",
                   "norm_topk_prob": True}
    elif family in ("qwen2_moe", "qwen3_moe"):
        fields |= _qwen_moe_fields(config, given, family)
    elif family == "dots1":
        fields |= _dots1_fields(given)
    else:
        fields |= {"ffn_hidden_size": given["intermediate_size"], **_DENSE_ATTENTION.get(family, {})}
    if fields["vocab_size"] < 1:  # the schema's 0 is a vision tower's; every family here is a language model
        raise HFConfigError(f"vocab_size={fields['vocab_size']}: a {family} model embeds tokens; give its vocabulary")
    try:
        return ModelSpec(**fields)
    except ConfigError as err:
        raise HFConfigError(f"{name}: {err}") from None


def _qwen_moe_fields(config: dict[str, Any], given: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: a softmax router (top-k renormalized with `norm_topk_prob`), every
    `decoder_sparse_step`-th layer MoE; Qwen2-MoE adds q/k/v biases and a sigmoid-gated shared expert,
    Qwen3-MoE normalizes query and key heads."""
    if given.get("mlp_only_layers"):
        raise HFConfigError(f"mlp_only_layers={given['mlp_only_layers']!r}: dense layers among the MoE ones are "
                            "built only as every decoder_sparse_step-th layer")
    experts = config.get("num_experts") or config.get("num_local_experts") or given["num_experts"]
    fields: dict[str, Any] = {
        "num_experts": experts, "top_k": given["num_experts_per_tok"], "router_score": "softmax",
        "norm_topk_prob": bool(given["norm_topk_prob"]), "moe_ffn_hidden_size": given["moe_intermediate_size"],
        "moe_layer_freq": given["decoder_sparse_step"], "ffn_hidden_size": given["intermediate_size"]}
    if family == "qwen3_moe":
        return fields | {"qk_norm": True}
    shared, width = given["shared_expert_intermediate_size"], given["moe_intermediate_size"]
    if shared % width:
        raise HFConfigError(f"shared_expert_intermediate_size={shared!r}: built as whole experts of "
                            f"moe_intermediate_size={width}, which does not divide it")
    return fields | {"qkv_bias": bool(given["qkv_bias"]), "num_shared_experts": shared // width,
                     "shared_expert_gate": shared > 0}


def _dots1_fields(given: dict[str, Any]) -> dict[str, Any]:
    """Dots1: DeepSeek-V3's router without latent attention: sigmoid scores, the correction bias (a balancing
    bias moved by DOTS1_BIAS_RATE in training), groups scored by their top-2 sum, `routed_scaling_factor`,
    the first `first_k_dense_replace` layers dense; QK-norm in every layer."""
    for key in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok"):
        if given[key] is None:
            raise HFConfigError(f"{key}: a dots1 config must give it (its class has no default)")
    return {"num_experts": given["n_routed_experts"], "top_k": given["num_experts_per_tok"],
            "router_score": "sigmoid", "norm_topk_prob": bool(given["norm_topk_prob"]),
            "routed_scaling_factor": float(given["routed_scaling_factor"]), "router_bias_rate": DOTS1_BIAS_RATE,
            "expert_groups": given["n_group"], "groups_per_token": given["topk_group"], "group_score": "top2_sum",
            "moe_ffn_hidden_size": given["moe_intermediate_size"], "num_shared_experts": given["n_shared_experts"],
            "first_dense_layers": given["first_k_dense_replace"], "ffn_hidden_size": given["intermediate_size"],
            "qk_norm": True}


# The JSON kind of each key read as a number or a switch: a quoted "24", a 24.0 or a "no" is refused by name, as
# transformers' own config classes refuse them, rather than failing in arithmetic or reading "no" as true.
_KINDS: dict[str, type] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "head_dim", "num_local_experts", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "decoder_sparse_step", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group",
                     "topk_group", "max_window_layers", "sliding_window"), int),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "initializer_range", "routed_scaling_factor",
                     "router_aux_loss_coef"), float),
    **dict.fromkeys(("tie_word_embeddings", "norm_topk_prob", "qkv_bias", "use_sliding_window"), bool),
}


def _check_kinds(config: dict[str, Any]) -> None:
    for key, value in config.items():
        if key in _KINDS and value is not None:
            try:
                check_scalar(f"{key}={value!r}", value, _KINDS[key])
            except ValueError as err:
                raise HFConfigError(str(err)) from None


def _check_keys(config: dict[str, Any], family: str) -> None:
    mapped = set(_DEFAULTS[family]) | _FAMILY_KEYS[family] | {
        "head_dim", "rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "use_sliding_window",
        "layer_types"}
    for key, given in config.items():
        if key in mapped:
            continue
        if key in _REFUSED:
            if given not in (None, 0, False, {}, []):
                raise HFConfigError(f"{key}={given!r}: {_REFUSED[key]}; orangetron does not build it")
        elif key in _REQUIRED:
            wanted, why = _REQUIRED[key]
            if given is not None and given != wanted:
                raise HFConfigError(f"{key}={given!r}: {why}; orangetron builds {key}={wanted!r} only")
        elif key not in _NEUTRAL:
            raise HFConfigError(f"{key}={given!r}: a {family} config key orangetron does not know; refused rather "
                                "than building a model that may differ")
    _check_window(config, family)


def _check_window(config: dict[str, Any], family: str) -> None:
    """Refuse an active sliding window. `layer_types` (transformers 5) names each layer's kind; without it a
    window is active where the family's class would apply it: Mixtral whenever it is set, the Qwen families
    with `use_sliding_window`; Qwen2, Qwen3 and Dots1 only on the layers from `max_window_layers` on."""
    kinds = config.get("layer_types")
    if kinds is not None:
        sliding = [i for i, kind in enumerate(kinds) if kind != "full_attention"]
        if sliding:
            raise HFConfigError(f"layer_types[{sliding[0]}]={kinds[sliding[0]]!r}: only full attention is built")
        return
    # A key left out means the class default (Qwen2/Qwen3: window 4096, switched off); null is no window.
    given = {**_DEFAULTS[family], **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
    window = given.get("sliding_window")
    switch = family.startswith("qwen")  # only the Qwen classes read use_sliding_window; Mistral's, Mixtral's and
    use = given.get("use_sliding_window", False) if switch else True  # Dots1's apply any window they are given
    # Qwen2, Qwen3 and Dots1 slide the layers from max_window_layers on; Mixtral and the Qwen MoE families, all
    first = given.get("max_window_layers", 0) if family in ("qwen2", "qwen3", "dots1") else 0
    active = window is not None and use and first < given["num_hidden_layers"]
    if active:
        accepted = "use_sliding_window: false, or null" if switch else "null"
        raise HFConfigError(f"sliding_window={window!r}: an active sliding window is not built (accepted with "
                            f"{accepted})")


def _rope_fields(config: dict[str, Any], family: str) -> dict[str, Any]:
    """rope_theta and the scaling fields, from transformers 5's `rope_parameters` or the older `rope_scaling`
    beside a top-level `rope_theta`."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise HFConfigError(f"rope_parameters={rope!r}: per-layer rope parameters are not built")
    theta = rope.get("rope_theta", config.get("rope_theta", _DEFAULTS[family]["rope_theta"]))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFConfigError(f"partial_rotary_factor={rope['partial_rotary_factor']!r}: the runtime rotates whole "
                            "heads")
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise HFConfigError(f"rope_type={kind!r}: orangetron builds default and llama3 rotary embeddings only")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in rope:
            raise HFConfigError(f"rope_parameters: llama3 scaling without {key!r}")
    original = rope.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    return {"rope_theta": float(theta), "rope_scaling": "llama3", "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_positions": int(original)}


def _moe_mismatches(spec: ModelSpec, family: str) -> list[tuple[str, str]]:
    """(field, why) for each field of the MoE `spec` that `family`'s HF model cannot hold."""
    one_router = [("router_bias_rate", spec.router_bias_rate == 0, "it has no balancing bias"),
                  ("expert_groups", spec.expert_groups <= 1, "it routes without groups"),
                  ("routed_scaling_factor", spec.routed_scaling_factor == 1.0, "it does not scale the weights"),
                  ("router_score", spec.router_score == "softmax", "its router is a softmax"),
                  ("first_dense_layers", spec.first_dense_layers == 0, "its dense layers are every "
                                                                        "decoder_sparse_step-th")]
    rules = {
        "mixtral": one_router + [
            ("norm_topk_prob", spec.norm_topk_prob, "it renormalizes the top-k probabilities"),
            ("num_shared_experts", spec.num_shared_experts == 0, "it has no shared expert"),
            ("moe_layer_freq", spec.moe_layer_freq == 1, "every layer is MoE"),
            ("qk_norm", not spec.qk_norm, "it has no QK-norm"), ("qkv_bias", not spec.qkv_bias, "it has no biases")],
        "qwen3_moe": one_router + [
            ("num_shared_experts", spec.num_shared_experts == 0, "it has no shared expert"),
            ("qk_norm", spec.qk_norm, "it normalizes query and key heads"),
            ("qkv_bias", not spec.qkv_bias, "it has no biases")],
        "qwen2_moe": one_router + [
            ("num_shared_experts", spec.num_shared_experts > 0, "it has a shared expert"),
            ("shared_expert_gate", spec.shared_expert_gate, "its shared expert is gated"),
            ("qk_norm", not spec.qk_norm, "it has no QK-norm")],
        "dots1": [
            ("router_score", spec.router_score == "sigmoid", "its router is a sigmoid"),
            ("group_score", spec.expert_groups <= 1 or spec.group_score == "top2_sum",
             "it scores a group by its top-2 sum"),
            ("moe_layer_freq", spec.moe_layer_freq == 1, "every layer after the dense ones is MoE"),
            ("num_shared_experts", spec.num_shared_experts > 0, "it has a shared expert"),
            ("shared_expert_gate", not spec.shared_expert_gate, "its shared expert is not gated"),
            ("qk_norm", spec.qk_norm, "it normalizes query and key heads"), ("qkv_bias", not spec.qkv_bias,
                                                                              "it has no biases")],
    }
    return [(field, why) for field, ok, why in rules[family] if not ok]


MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "dots1")


def hf_family(spec: ModelSpec, preferred: str | None = None) -> str:
    """The family a spec exports as: dense "llama" ("mistral" when `preferred`, an imported model's own family, is
    that), "qwen2" (q/k/v biases) or "qwen3" (QK-norm); for MoE
    `preferred` (an imported model's own family) when it holds the spec, else the first of MOE_FAMILIES that
    does. HFConfigError names the field that keeps the closest family from holding it."""
    if not spec.is_moe:
        dense = _dense_family(spec)
        return "mistral" if preferred == "mistral" and dense == "llama" else dense  # the same network, its class
    misses = {family: _moe_mismatches(spec, family) for family in MOE_FAMILIES}
    if preferred in misses and not misses[preferred]:
        return preferred
    for family in MOE_FAMILIES:
        if not misses[family]:
            return family
    closest = min(MOE_FAMILIES, key=lambda family: len(misses[family]))
    field, why = misses[closest][0]
    raise HFConfigError(f"{field}={getattr(spec, field)!r}: no Hugging Face family here holds this MoE (the "
                        f"closest, {closest}, cannot: {why}); export --hf writes {', '.join(_DEFAULTS)} models")


def _dense_family(spec: ModelSpec) -> str:
    if spec.qkv_bias and spec.qk_norm:
        raise HFConfigError("qkv_bias=True: no Hugging Face family here has q/k/v biases and QK-norm together "
                            "(Qwen2 has the biases, Qwen3 the norm)")
    return "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias else "llama"


def hf_config_of(spec: ModelSpec, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config.json for `spec` with tensors in `dtype` ("float32", ...): `base` (the source config of an
    imported model, whose other keys such as token ids are kept) updated with every key the spec decides."""
    family = hf_family(spec, None if base is None else base.get("model_type"))
    if base is not None and base.get("model_type") not in (None, family):
        base = None  # the spec changed family: start afresh
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": spec.rope_theta, "factor": spec.rope_scaling_factor,
                "low_freq_factor": spec.rope_low_freq_factor, "high_freq_factor": spec.rope_high_freq_factor,
                "original_max_position_embeddings": spec.rope_original_max_positions}
    spelled_by_family = ("rope_scaling", "torch_dtype", "num_experts", "num_local_experts", "layer_types")
    # The version of transformers that wrote `base`: this file is not its writing, and it spells rope as
    # transformers 5 does, so an older version's label would misdate it.
    not_ours_to_claim = ("transformers_version",)
    config = {k: v for k, v in (base or {}).items() if k not in spelled_by_family + not_ours_to_claim}
    config |= {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.norm_eps, "max_position_embeddings": spec.max_seq_len,
        "tie_word_embeddings": spec.tied_embeddings, "initializer_range": spec.init_std, "hidden_act": "silu",
        "attention_dropout": 0.0, "rope_parameters": rope, "rope_theta": spec.rope_theta, "dtype": dtype,
    }
    return dict(sorted((config | _family_keys(spec, family)).items()))


def _family_keys(spec: ModelSpec, family: str) -> dict[str, Any]:
    """The keys of `family`'s config that hold the spec's feed-forward, router and attention variants."""
    keys = _variant_keys(spec, family)
    if spec.aux_loss_coef > 0 and family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        # The coefficient the run trained with, where transformers would read its own default (0.001) in; an
        # import's 0 (HF trains without the loss unless asked) leaves its source's value.
        keys["router_aux_loss_coef"] = spec.aux_loss_coef
    return keys


def _variant_keys(spec: ModelSpec, family: str) -> dict[str, Any]:
    if family == "mixtral":
        return {"intermediate_size": spec.moe_ffn_hidden_size, "num_local_experts": spec.num_experts,
                "num_experts_per_tok": spec.top_k, "sliding_window": None, "output_router_logits": False,
                "router_jitter_noise": 0.0}
    if family == "llama":
        return {"intermediate_size": spec.ffn_hidden_size, "attention_bias": False, "mlp_bias": False}
    if family == "mistral":  # full attention: no window
        return {"intermediate_size": spec.ffn_hidden_size, "sliding_window": None}
    if family in _DENSE_ATTENTION:  # Qwen2, Qwen3: full attention on every layer
        dense = {"intermediate_size": spec.ffn_hidden_size, "use_sliding_window": False, "sliding_window": None,
                 "max_window_layers": spec.num_layers, "layer_types": ["full_attention"] * spec.num_layers}
        return dense | ({"attention_bias": False} if family == "qwen3" else {})
    moe = {"intermediate_size": spec.ffn_hidden_size or spec.moe_ffn_hidden_size, "num_experts_per_tok": spec.top_k,
           "moe_intermediate_size": spec.moe_ffn_hidden_size, "norm_topk_prob": spec.norm_topk_prob,
           "output_router_logits": False}
    if family == "dots1":
        return moe | {"n_routed_experts": spec.num_experts, "n_shared_experts": spec.num_shared_experts,
                      "first_k_dense_replace": spec.first_dense_layers, "n_group": max(spec.expert_groups, 1),
                      "topk_group": max(spec.groups_per_token, 1),
                      "routed_scaling_factor": spec.routed_scaling_factor, "attention_bias": False,
                      "sliding_window": None, "layer_types": ["full_attention"] * spec.num_layers}
    qwen = moe | {"num_experts": spec.num_experts, "decoder_sparse_step": spec.moe_layer_freq,
                  "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None}
    if family == "qwen3_moe":
        return qwen | {"attention_bias": False}
    return qwen | {"qkv_bias": spec.qkv_bias, "layer_types": ["full_attention"] * spec.num_layers,
                   "shared_expert_intermediate_size": spec.shared_ffn_hidden_size}
