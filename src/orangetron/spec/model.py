"""The one model schema, `ModelSpec`, that the runtime builds, the planner prices and checkpoints record;
TOML files (and the shipped presets) -> `ModelSpec`; parameter counts.

A decoder is described by the keys docs/planner.md section 1 lists. Optional keys cover the variants the presets need:
`head_dim` (when heads x head_dim != hidden, as GPT-OSS and Qwen3), `first_dense_layers` (DeepSeek-V3's
leading dense layers), `bias` and `max_position_embeddings` (GPT-3 style learned positions and biases),
group-limited routing (`expert_groups`, `groups_per_token`: how many EP ranks or nodes a token may reach),
and MLA (`q_lora_rank`, `kv_lora_rank`, `qk_rope_head_dim`, `v_head_dim`) whose parameters are counted
exactly while its activations and attention FLOPs are priced as multi-head attention with
`head_dim + qk_rope_head_dim` query/key width (see docs/planner.md).

A dual encoder (CLIP, CoCa, LiT) is a TOML file with `kind = "dual_encoder"` and one `[towers.NAME]`
table per modality, each a small encoder description plus `seq_len` (tokens per sample) and `patch_size`
for vision towers; see `DualEncoderSpec`.

The runtime's fields (`rope_theta`, `norm_eps`, `max_seq_len`, `init_std`, the router's options) sit beside
the planner's, and the runtime's argument names (`ModelConfig(dim=..., n_layers=...)`, model/config.py) map
onto the schema's once, in `RUNTIME_NAMES`.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from importlib import resources
from operator import attrgetter
from pathlib import Path
from typing import Any

from orangetron.spec.keys import hash_fields_once
from orangetron.spec.model_rules import ConfigError, check_model
from orangetron.spec.toml_values import check_scalar

_PRESET_DIR = "presets/models"


@dataclass(frozen=True)
class ModelSpec:
    """One model description for the runtime, the planner and checkpoints: a decoder or an encoder tower.

    The planner prices every spec; the runtime builds those `orangetron.model.config.check_runnable` accepts
    and refuses the others naming the field. Rules are checked on construction (spec/model_rules.py,
    `ConfigError`). Zeros that stand for a derived value are then resolved, so the fields always hold the
    shape: `head_dim` 0 becomes hidden_size // num_heads, `num_kv_heads` 0 becomes num_heads, and
    `expert_groups` / `groups_per_token` 0 become 1 (one group). `dataclasses.replace` keeps resolved values;
    `with_changes` derives them again. The runtime's argument names (`dim`, `n_layers`, ...) read as
    properties (`RUNTIME_NAMES`).
    """

    name: str
    """A label (preset name, TOML file stem) for reports; not part of the shape."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Query heads per attention layer."""
    vocab_size: int
    """Token ids: embedding rows and logits columns (0 for a vision tower)."""
    ffn_hidden_size: int = 0
    """Hidden width of a dense layer's MLP; positive when some layer is dense."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); num_heads divides by it. 0: num_heads (multi-head)."""
    head_dim: int = 0
    """Width of one head; 0: hidden_size // num_heads (GPT-OSS and Qwen3 set their own)."""
    mlp: str = "swiglu"
    """MLP kind: "swiglu" (gate, up and down matrices) or "gelu" (up and down)."""
    dropout: float = 0.0
    """Dropout probability after attention and MLP; > 0 keeps the dropout masks."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 makes every layer dense."""
    top_k: int = 0
    """Experts each token is routed to: 1..num_experts for a MoE model."""
    moe_ffn_hidden_size: int = 0
    """Hidden width of one expert (routed or shared); positive for a MoE model."""
    num_shared_experts: int = 0
    """Always-on experts per MoE layer (the runtime fuses them into one MLP of width
    num_shared_experts * moe_ffn_hidden_size)."""
    moe_layer_freq: int = 1
    """After the leading dense layers, every moe_layer_freq-th layer is MoE (`is_moe_layer`)."""
    first_dense_layers: int = 0
    """Leading layers that stay dense in a MoE model (DeepSeek-V3: 3)."""
    tied_embeddings: bool = False
    """The token-embedding matrix is also the output projection."""
    bias: bool = False
    """GPT style: linear layers carry biases and norms are LayerNorms; False: no biases, RMSNorm."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only, none on the output projection (Qwen2)."""
    qk_norm: bool = False
    """An RMSNorm with a learned weight over head_dim (epsilon norm_eps) on each query and key head, before the
    rotary embedding (Qwen3, Qwen3-MoE, Dots1)."""
    max_position_embeddings: int = 0
    """> 0: learned absolute positions (GPT-3) for this many positions; 0: rotary embeddings."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3): rank of the query compression; 0: none."""
    kv_lora_rank: int = 0
    """> 0: multi-head latent attention with keys and values compressed to this rank."""
    qk_rope_head_dim: int = 0
    """MLA: the rotary part of each query/key head, beside head_dim's position-free part."""
    v_head_dim: int = 0
    """MLA: width of a value head; 0: head_dim."""
    causal: bool = True
    """Causal attention (decoders); False: bidirectional (encoder towers)."""
    patch_size: int = 0
    """Vision towers: a patch embedding of this patch size replaces the token embedding."""
    seq_len: int = 0
    """Towers: tokens per sample (a decoder's sequence length comes with the job, not the model)."""
    aux_loss_coef: float = 0.0
    """Weight of the MoE load-balancing loss; > 0 under EP adds its global all-reduce."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE): the mean over non-padding tokens of logsumexp(router logits)^2;
    > 0 keeps the router logits, and adds a global all-reduce."""
    router_score: str = "softmax"
    """Router scoring function: "softmax" or "sigmoid"; either way the top-k weights are renormalized only
    with `norm_topk_prob`."""
    norm_topk_prob: bool = False
    """Divide each token's top-k scores by their sum, softmax and sigmoid routers alike (Mixtral, DeepSeek-V3,
    Dots1; HF configs' `norm_topk_prob`); False keeps the raw scores as the weights."""
    routed_scaling_factor: float = 1.0
    """The routed experts' top-k weights are multiplied by this after any renormalization (HF configs'
    `routed_scaling_factor`; DeepSeek-V3 and Dots1: 2.5); the shared experts are not scaled."""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): > 0 gives each router a per-expert bias, added to the
    scores only to choose the top-k and moved by this rate towards balance after each optimizer step (one
    all-reduce of the expert loads per step)."""
    expert_groups: int = 0
    """Group-limited routing (HF configs' n_group): the experts form this many equal groups of consecutive
    ids; 0 or 1: no limit."""
    groups_per_token: int = 0
    """Group-limited routing (HF configs' topk_group): a token's experts come from at most this many groups,
    those with the highest `group_score`; DeepSeek-V3: 8 groups, 4 per token."""
    group_score: str = "max"
    """Group-limited routing: a group's score is "max", its largest expert score (DeepSeek-V2), or "top2_sum",
    the sum of its two largest (DeepSeek-V3, Dots1); either way the scores include the balancing bias."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared experts' output is multiplied per token by sigmoid(x @ w), w a hidden_size -> 1
    linear without bias (HF's `shared_expert_gate`); needs num_shared_experts > 0."""
    mtp_layers: int = 0
    """Multi-token prediction (DeepSeek-V3's depth D, Megatron's --mtp-num-layers, HF configs'
    num_nextn_predict_layers): modules after the decoder on the last pipeline stage, each two norms on its
    inputs, a 2h -> h projection, one layer of the decoder's last layer's kind, a norm, and its own pass
    through the shared output head and the loss. Not in `total_params` (the published counts leave it out)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rope_scaling: str = "none"
    """Rotary frequency scaling: "none", or "llama3" (Llama 3.1: frequencies whose wavelength exceeds
    rope_original_max_positions / rope_low_freq_factor are divided by rope_scaling_factor, those below
    rope_original_max_positions / rope_high_freq_factor kept, the band between interpolated smoothly;
    model/layers.py `rope_inv_freq`)."""
    rope_scaling_factor: float = 1.0
    """llama3 scaling: the factor low frequencies are divided by (Llama 3.1: 8)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above rope_original_max_positions / this are scaled (Llama 3.1: 1)."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below rope_original_max_positions / this are kept (Llama 3.1: 4)."""
    rope_original_max_positions: int = 8192
    """llama3 scaling: the context length the model was pretrained at (Llama 3.1: 8192)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    max_seq_len: int = 4096
    """Longest sequence the runtime's forward pass accepts."""
    init_std: float = 0.02
    """Standard deviation of the runtime's normal initialization of weight matrices."""

    __hash__ = hash_fields_once  # keys the cost caches: hashed once

    def __post_init__(self) -> None:
        check_model(self)
        _resolve_derived(self)

    def with_changes(self, **changes: Any) -> ModelSpec:
        """A copy with `changes` (field names); `head_dim` and `num_kv_heads` that hold their derived value
        are derived again from the changed fields (`dataclasses.replace` would keep them)."""
        derived = {"head_dim": self.hidden_size // self.num_heads, "num_kv_heads": self.num_heads}
        again = {name: 0 for name, value in derived.items() if getattr(self, name) == value}
        return replace(self, **{**again, **changes})

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width (MLA: nope + rope parts)."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def shared_ffn_hidden_size(self) -> int:
        """Width of the fused shared-expert MLP (0 without shared experts)."""
        return self.num_shared_experts * self.moe_ffn_hidden_size

    @property
    def router_bias(self) -> bool:
        """Routers carry the auxiliary-loss-free balancing bias (`router_bias_rate` > 0 in a MoE model)."""
        return self.is_moe and self.router_bias_rate > 0

    @property
    def group_limited(self) -> bool:
        return 0 < self.groups_per_token < self.expert_groups

    def allowed_bins(self, bins: int) -> int:
        """The most of `bins` equal contiguous slices of the experts (EP ranks, nodes) one token can reach under
        group-limited routing: its groups_per_token groups, each a contiguous run of w experts, which crosses at
        most 1 + ceil((w - gcd(w, b)) / b) slices of b experts."""
        if not self.group_limited:
            return bins
        w, b = self.num_experts // self.expert_groups, self.num_experts // bins
        span = 1 + -(-(w - math.gcd(w, b)) // b)
        return min(bins, self.groups_per_token * span)

    def routed_ranks(self, ep: int) -> int:
        """EP ranks one token's copies go to under balanced routing: its experts on as many ranks as allowed."""
        return min(self.top_k, self.allowed_bins(ep))

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` (0-based) has routed experts."""
        if not self.is_moe or index < self.first_dense_layers:
            return False
        # With a frequency k, layers k-1, 2k-1, ... after the leading dense ones are MoE.
        return (index - self.first_dense_layers + 1) % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return _num_moe_layers(self)

    # ---- parameter counts -----------------------------------------------------------------------
    def attention_params(self) -> int:
        """Projection weights (and biases) of one attention block, norms excluded."""
        h = self.hidden_size
        if self.kv_lora_rank:
            nope = self.qk_head_dim - self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * self.qk_head_dim
                 if self.q_lora_rank else h * self.num_heads * self.qk_head_dim)
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.num_heads * (nope + self.v_dim))
            return q + kv + self.num_heads * self.v_dim * h
        q_width = self.num_heads * self.qk_head_dim
        kv_width = self.kv_heads * self.qk_head_dim
        weights = h * (q_width + 2 * kv_width) + q_width * h
        qkv_biases = (q_width + 2 * kv_width) if self.has_qkv_bias else 0
        return weights + qkv_biases + (h if self.bias else 0)

    def mlp_params(self, ffn: int) -> int:
        """One dense MLP (or one expert) of width `ffn`."""
        h = self.hidden_size
        if self.mlp == "swiglu":
            return 3 * h * ffn + ((2 * ffn + h) if self.bias else 0)
        return 2 * h * ffn + ((ffn + h) if self.bias else 0)

    @property
    def has_qkv_bias(self) -> bool:
        """The query, key and value projections carry biases (`qkv_bias`, or every linear layer's `bias`)."""
        return self.bias or self.qkv_bias

    def qk_norm_params(self) -> int:
        """The QK-norm weights of one layer (query and key, one head width each); 0 without QK-norm."""
        return 2 * self.qk_head_dim if self.qk_norm else 0

    def norm_params(self) -> int:
        """The norms of one layer, all replicated over tp: the two block norms and the QK-norm weights."""
        # RMSNorm carries a weight, LayerNorm (with biases, GPT style) a weight and a bias.
        return 2 * self.hidden_size * (2 if self.bias else 1) + self.qk_norm_params()

    def expert_params_per_layer(self) -> int:
        """Routed-expert weights of one MoE layer (all experts)."""
        return self.num_experts * self.mlp_params(self.moe_ffn_hidden_size)

    def dense_params_of_layer(self, index: int) -> int:
        """Weights of layer `index` that every data-parallel replica holds (everything but routed experts)."""
        base = self.attention_params() + self.norm_params()
        if not self.is_moe_layer(index):
            return base + self.mlp_params(self.ffn_hidden_size)
        router = self.num_experts * self.hidden_size
        shared = self.num_shared_experts * self.mlp_params(self.moe_ffn_hidden_size)
        return base + router + shared + self.shared_gate_params

    @property
    def shared_gate_params(self) -> int:
        """The shared-expert gate's weights in one MoE layer (hidden_size -> 1), 0 without the gate."""
        return self.hidden_size if self.shared_expert_gate else 0

    def layer_params(self, index: int) -> int:
        routed = self.expert_params_per_layer() if self.is_moe_layer(index) else 0
        return self.dense_params_of_layer(index) + routed

    def embedding_params(self) -> int:
        """Input embedding (or patch embedding) plus learned positions."""
        if self.patch_size:
            table = 3 * self.patch_size**2 * self.hidden_size + self.hidden_size
        else:
            table = self.vocab_size * self.hidden_size
        positions = self.max_position_embeddings * self.hidden_size
        return table + positions

    def output_params(self) -> int:
        """Final norm plus (untied) output projection."""
        final_norm = self.hidden_size * (2 if self.bias else 1)
        untied = not (self.tied_embeddings or self.patch_size or not self.vocab_size)
        head = self.vocab_size * self.hidden_size if untied else 0
        return final_norm + head

    def all_layer_params(self) -> int:
        """Sum of `layer_params` over every layer."""
        return _all_layer_params(self)

    def total_params(self) -> int:
        return self.all_layer_params() + self.embedding_params() + self.output_params()

    def active_params(self) -> int:
        """Parameters one token touches: routed experts count top_k of num_experts."""
        total = self.total_params()
        if not self.is_moe:
            return total
        idle = (self.num_experts - self.top_k) * self.mlp_params(self.moe_ffn_hidden_size)
        return total - idle * self.num_moe_layers

    def mtp_module_params(self) -> int:
        """One multi-token-prediction module: three norms, the 2h -> h projection and its layer (the embedding
        and the output head are shared)."""
        return self.mtp_norm_params() + 2 * self.hidden_size**2 + self.layer_params(self.mtp_layer_index)

    def mtp_norm_params(self) -> int:
        """An MTP module's norms: one on each of its two inputs, one before the head."""
        return 3 * self.hidden_size * (2 if self.bias else 1)

    @property
    def mtp_layer_index(self) -> int:
        """A decoder layer of the kind an MTP module's layer is: the last one."""
        return self.num_layers - 1

    def expert_params(self) -> int:
        """All routed-expert weights (sharded over ep, replicated over edp)."""
        return self.expert_params_per_layer() * self.num_moe_layers


@lru_cache(maxsize=256)
def _num_moe_layers(spec: ModelSpec) -> int:
    return sum(spec.is_moe_layer(i) for i in range(spec.num_layers))


@lru_cache(maxsize=256)
def _all_layer_params(spec: ModelSpec) -> int:
    return sum(spec.layer_params(i) for i in range(spec.num_layers))


def _resolve_derived(spec: ModelSpec) -> None:
    """Store the values the zeros stand for (the spec is frozen: set once, before anything hashes it)."""
    resolved = {"head_dim": spec.head_dim or spec.hidden_size // spec.num_heads,
                "num_kv_heads": spec.num_kv_heads or spec.num_heads,
                "expert_groups": spec.expert_groups or 1, "groups_per_token": spec.groups_per_token or 1}
    for name, value in resolved.items():
        object.__setattr__(spec, name, value)


# The runtime's argument names (ModelConfig, model/config.py; a stable contract) -> the schema's fields.
# They read as properties of ModelSpec; `ModelConfig(...)` and old checkpoints map through this table too.
RUNTIME_NAMES: dict[str, str] = {
    "dim": "hidden_size", "n_layers": "num_layers", "n_heads": "num_heads", "n_kv_heads": "num_kv_heads",
    "ffn_dim": "ffn_hidden_size", "n_experts": "num_experts", "moe_ffn_dim": "moe_ffn_hidden_size",
    "n_shared_experts": "num_shared_experts", "n_expert_groups": "expert_groups",
    "topk_groups": "groups_per_token", "shared_ffn_dim": "shared_ffn_hidden_size",
}
for _runtime_name, _schema_name in RUNTIME_NAMES.items():
    setattr(ModelSpec, _runtime_name, property(attrgetter(_schema_name), doc=f"`{_schema_name}` (runtime name)"))

_SCHEMA_WORDS = re.compile(r"\b(" + "|".join(RUNTIME_NAMES.values()) + r")\b")
_RUNTIME_WORDS = {schema: runtime for runtime, schema in RUNTIME_NAMES.items()}


def in_runtime_names(error: ConfigError) -> ConfigError:
    """The same error worded with the runtime's argument names (for `ModelConfig(dim=...)` callers)."""
    return ConfigError(_SCHEMA_WORDS.sub(lambda word: _RUNTIME_WORDS[word.group(0)], str(error)))


@dataclass(frozen=True)
class DualEncoderSpec:
    """A multimodal dual encoder (CLIP / CoCa / LiT): independent towers joined by a contrastive loss."""

    name: str
    towers: dict[str, ModelSpec] = field(default_factory=dict)
    embed_dim: int = 512  # contrastive projection width

    def total_params(self) -> int:
        proj = sum(t.hidden_size * self.embed_dim for t in self.towers.values())
        return sum(t.total_params() for t in self.towers.values()) + proj


_SPEC_FIELDS = {f.name for f in fields(ModelSpec)}
_FIELD_TYPES = {f.name: f.type for f in fields(ModelSpec)}  # annotations, as strings
_SCALAR_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


# Keys of a run's config file (`train --config`, `plan --emit-config`), which no model file has.
_RUN_FILE_KEYS = ("model", "batch_size", "steps")


def _spec_from_table(name: str, table: dict) -> ModelSpec:
    unknown = sorted(set(table) - _SPEC_FIELDS - {"kind", "description", "source"})
    run_keys = [key for key in _RUN_FILE_KEYS if key in unknown]
    if run_keys:
        raise ValueError(f"model {name}: a run's config file (it sets {', '.join(run_keys)}), not a model file: "
                         "`train --config` and `estimate --config` take it, and --model the model it names")
    if unknown:
        hints = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, _SPEC_FIELDS, 1, 0.6))
                 else key for key in unknown]
        raise ValueError(f"model {name}: unknown key(s) {', '.join(hints)}")
    values = {k: v for k, v in table.items() if k in _SPEC_FIELDS}
    missing = [k for k in ("hidden_size", "num_layers", "num_heads") if k not in values]
    if missing:
        raise ValueError(f"model {name}: missing key(s) {', '.join(missing)}")
    for key, value in values.items():
        check_scalar(f"model {name}: {key} = {value!r}", value, _SCALAR_TYPES[_FIELD_TYPES[key]])
    values.setdefault("vocab_size", 0)
    values["name"] = name
    try:
        return ModelSpec(**values)
    except ConfigError as err:
        raise ConfigError(f"model {name}: {err}") from None


def parse_model(name: str, table: dict) -> ModelSpec | DualEncoderSpec:
    """Build a spec from a parsed TOML table (`kind = "dual_encoder"` selects `DualEncoderSpec`)."""
    if table.get("kind") == "dual_encoder":
        towers = {tname: _spec_from_table(f"{name}.{tname}", t) for tname, t in table.get("towers", {}).items()}
        if len(towers) < 2:
            raise ValueError(f"model {name}: a dual encoder needs at least two [towers.NAME] tables")
        return DualEncoderSpec(name=name, towers=towers, embed_dim=int(table.get("embed_dim", 512)))
    return _spec_from_table(name, table)


def preset_names() -> list[str]:
    """Names of the shipped model presets."""
    root = resources.files("orangetron.spec").joinpath(_PRESET_DIR)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_model(name_or_path: str) -> ModelSpec | DualEncoderSpec:
    """A preset name (`llama3-8b`), a path to a TOML file, or a Hugging Face model folder (its config.json,
    spec/hf_config.py); ValueError names the choices when unknown."""
    path = Path(name_or_path)
    if path.name == "config.json" and path.is_file():  # a Hugging Face folder's own file stands for the folder
        path = path.parent
    if path.is_dir():
        from orangetron.spec.hf_config import read_config, spec_from_hf

        return spec_from_hf(read_config(path), path.resolve().name)
    if name_or_path.endswith(".toml") or path.exists():
        if not path.is_file():
            raise ValueError(f"model file {name_or_path} does not exist")
        text, name = path.read_text(), path.stem
    else:
        names = preset_names()
        if name_or_path not in names:
            raise ValueError(f"unknown model preset {name_or_path!r}; choose one of {', '.join(names)} "
                             "or pass a .toml file")
        text = resources.files("orangetron.spec").joinpath(_PRESET_DIR, f"{name_or_path}.toml").read_text()
        name = name_or_path
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"model {name}: invalid TOML: {err}") from None
    try:
        return parse_model(name, table)
    except TypeError as err:  # a value of the wrong type reaching the dataclass
        raise ValueError(f"model {name}: {err}") from None


def load_decoder(name_or_path: str) -> ModelSpec:
    """Like `load_model`, but refuses dual encoders (which only `plan` prices, as a DistMM plan)."""
    spec = load_model(name_or_path)
    if isinstance(spec, DualEncoderSpec):
        raise ValueError(f"model {spec.name} is a dual encoder, which only `orangetron plan --model {spec.name}` "
                         "prices (a DistMM plan)")
    return spec
