"""Model descriptions for the planner: TOML files (and shipped presets) -> `ModelSpec`, parameter counts.

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
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path

from orangetron.spec.keys import hash_fields_once

_PRESET_DIR = "presets/models"


@dataclass(frozen=True)
class ModelSpec:
    """A decoder (or encoder tower) shape; every count below is derived from these fields."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    ffn_hidden_size: int = 0
    num_kv_heads: int = 0  # 0: same as num_heads (multi-head attention)
    head_dim: int = 0  # 0: hidden_size // num_heads
    mlp: str = "swiglu"  # "swiglu" | "gelu"
    dropout: float = 0.0
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_hidden_size: int = 0
    num_shared_experts: int = 0
    moe_layer_freq: int = 1
    first_dense_layers: int = 0
    tied_embeddings: bool = False
    bias: bool = False
    max_position_embeddings: int = 0  # >0: learned absolute positions (GPT-3), else RoPE
    q_lora_rank: int = 0
    kv_lora_rank: int = 0  # >0: multi-head latent attention (DeepSeek-V3)
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    causal: bool = True
    patch_size: int = 0  # vision towers: a patch embedding replaces the token embedding
    seq_len: int = 0  # towers: tokens per sample
    aux_loss_coef: float = 0.0  # MoE balancing loss weight; >0 under EP adds its global all-reduce
    router_z_loss_coef: float = 0.0  # router z-loss weight; >0 keeps the router logits, a global all-reduce
    router_bias: bool = False  # auxiliary-loss-free balancing: one all-reduce of the expert loads per step
    # Group-limited routing (the runtime's `n_expert_groups`, `topk_groups`; HF configs' `n_group`, `topk_group`):
    # experts form `expert_groups` equal contiguous groups and a token's experts come from at most
    # `groups_per_token` of them (DeepSeek-V3: 8 and 4, one group per node); 0: no limit
    expert_groups: int = 0
    groups_per_token: int = 0
    # Multi-token prediction (DeepSeek-V3's depth D, Megatron's --mtp-num-layers, HF configs'
    # num_nextn_predict_layers): modules after the decoder on the last pipeline stage, each two norms on its
    # inputs, a 2h -> h projection, one layer of the decoder's last layer's kind, a norm, and its own pass
    # through the shared output head and the loss. Not in `total_params` (the published counts leave it out)
    mtp_layers: int = 0

    __hash__ = hash_fields_once  # keys the cost caches: hashed once

    def __post_init__(self) -> None:
        _check_spec(self)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width (MLA: nope + rope parts)."""
        return (self.head_dim or self.hidden_size // self.num_heads) + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        # Same rule as the runtime's ModelConfig: with a frequency k, layers k-1, 2k-1, ... are MoE.
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
        biases = (q_width + 2 * kv_width + h) if self.bias else 0
        return weights + biases

    def mlp_params(self, ffn: int) -> int:
        """One dense MLP (or one expert) of width `ffn`."""
        h = self.hidden_size
        if self.mlp == "swiglu":
            return 3 * h * ffn + ((2 * ffn + h) if self.bias else 0)
        return 2 * h * ffn + ((ffn + h) if self.bias else 0)

    def norm_params(self) -> int:
        # RMSNorm carries a weight, LayerNorm (with biases, GPT style) a weight and a bias.
        return 2 * self.hidden_size * (2 if self.bias else 1)

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
        return base + router + shared

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


def _check_spec(spec: ModelSpec) -> None:
    positive = ("hidden_size", "num_layers", "num_heads")
    for name in positive:
        if getattr(spec, name) <= 0:
            raise ValueError(f"model {spec.name}: {name}={getattr(spec, name)} must be positive")
    if spec.mlp not in ("swiglu", "gelu"):
        raise ValueError(f"model {spec.name}: mlp={spec.mlp!r} must be 'swiglu' or 'gelu'")
    if spec.num_heads % spec.kv_heads:
        raise ValueError(f"model {spec.name}: num_heads={spec.num_heads} is not divisible by "
                         f"num_kv_heads={spec.kv_heads}")
    if spec.is_moe and not (0 < spec.top_k <= spec.num_experts and spec.moe_ffn_hidden_size > 0):
        raise ValueError(f"model {spec.name}: MoE needs 0 < top_k <= num_experts and moe_ffn_hidden_size > 0")
    _check_groups(spec)
    if spec.mtp_layers < 0:
        raise ValueError(f"model {spec.name}: mtp_layers={spec.mtp_layers} must be >= 0")
    if spec.moe_layer_freq < 1:
        raise ValueError(f"model {spec.name}: moe_layer_freq={spec.moe_layer_freq} must be >= 1")
    if not spec.is_moe and spec.ffn_hidden_size <= 0:
        raise ValueError(f"model {spec.name}: ffn_hidden_size must be positive for a dense model")


def _check_groups(spec: ModelSpec) -> None:
    """The runtime's rules (`ModelConfig._check_groups`): groups split the experts evenly, a token picks at
    most all of them, and its top_k experts fit in the groups it picks."""
    groups, per_token = spec.expert_groups, spec.groups_per_token
    if not (groups or per_token):
        return
    if not spec.is_moe:
        raise ValueError(f"model {spec.name}: expert_groups and groups_per_token need experts (num_experts > 0)")
    if not (groups > 0 and spec.num_experts % groups == 0 and 0 < per_token <= groups):
        raise ValueError(f"model {spec.name}: groups_per_token={per_token} needs 1 <= groups_per_token <= "
                         f"expert_groups={groups}, which must divide num_experts={spec.num_experts}; set both")
    reachable = per_token * (spec.num_experts // groups)
    if spec.top_k > reachable:
        raise ValueError(f"model {spec.name}: top_k={spec.top_k} exceeds the {reachable} experts of "
                         f"groups_per_token={per_token} groups")


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


def _spec_from_table(name: str, table: dict) -> ModelSpec:
    unknown = sorted(set(table) - _SPEC_FIELDS - {"kind", "description", "source"})
    if unknown:
        raise ValueError(f"model {name}: unknown key(s) {', '.join(unknown)}")
    values = {k: v for k, v in table.items() if k in _SPEC_FIELDS}
    missing = [k for k in ("hidden_size", "num_layers", "num_heads") if k not in values]
    if missing:
        raise ValueError(f"model {name}: missing key(s) {', '.join(missing)}")
    values.setdefault("vocab_size", 0)
    values["name"] = name
    return ModelSpec(**values)


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
    """A preset name (`llama3-8b`) or a path to a TOML file; ValueError names the choices when unknown."""
    path = Path(name_or_path)
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


def spec_from_model_config(cfg: object, name: str = "runtime") -> ModelSpec:
    """The planner's view of a runtime `orangetron.ModelConfig` (read by attribute; no torch import)."""
    return ModelSpec(
        name=name, hidden_size=cfg.dim, num_layers=cfg.n_layers, num_heads=cfg.n_heads,
        num_kv_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size, ffn_hidden_size=cfg.ffn_dim, mlp="swiglu",
        num_experts=cfg.n_experts, top_k=cfg.top_k if cfg.n_experts else 0,
        moe_ffn_hidden_size=(cfg.moe_ffn_dim or cfg.ffn_dim) if cfg.n_experts else 0,
        num_shared_experts=cfg.n_shared_experts, moe_layer_freq=cfg.moe_layer_freq,
        tied_embeddings=cfg.tied_embeddings, aux_loss_coef=cfg.aux_loss_coef if cfg.n_experts else 0.0,
        router_z_loss_coef=getattr(cfg, "router_z_loss_coef", 0.0) if cfg.n_experts else 0.0,
        router_bias=bool(getattr(cfg, "router_bias_rate", 0.0)) and cfg.n_experts > 0,
        **_runtime_groups(cfg),
    )


def _runtime_groups(cfg: object) -> dict[str, int]:
    """The runtime router's group limit (`n_expert_groups`, `topk_groups`; one group means none)."""
    groups = getattr(cfg, "n_expert_groups", 1) if cfg.n_experts else 1
    if groups <= 1:
        return {}
    return {"expert_groups": groups, "groups_per_token": cfg.topk_groups}


def load_decoder(name_or_path: str) -> ModelSpec:
    """Like `load_model`, but refuses dual encoders (which only `plan --distmm` prices)."""
    spec = load_model(name_or_path)
    if isinstance(spec, DualEncoderSpec):
        raise ValueError(f"model {spec.name} is a dual encoder; use `orangetron plan --distmm`")
    return spec
