"""Model configuration: one frozen dataclass, validated on construction, plus named presets."""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_SCORES = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A model configuration breaks a rule; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder with optional MoE feed-forward layers.

    `moe_ffn_dim=None` is resolved to `ffn_dim` on construction, so after `__post_init__` it is always an
    int (note: `dataclasses.replace(cfg, ffn_dim=...)` keeps the resolved `moe_ffn_dim`).
    """

    dim: int
    """Hidden size of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads per attention layer; `dim` must divide by it."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); `n_heads` must divide by it."""
    vocab_size: int
    """Number of token ids (embedding rows and logits columns)."""
    ffn_dim: int
    """Hidden size of the dense SwiGLU feed-forward."""
    n_experts: int = 0
    """Routed experts per MoE layer; 0 makes every layer dense."""
    top_k: int = 2
    """Experts each token is routed to (MoE only); at most `n_experts`."""
    moe_ffn_dim: int | None = None
    """Hidden size of one expert's SwiGLU; None means `ffn_dim`."""
    n_shared_experts: int = 0
    """Always-on experts per MoE layer, fused into one SwiGLU of hidden `n_shared_experts * moe_ffn_dim`."""
    moe_layer_freq: int = 1
    """Layer i is MoE when `n_experts > 0` and `(i + 1) % moe_layer_freq == 0`."""
    router_score: str = "softmax"
    """Router scoring function: "softmax" or "sigmoid" (sigmoid top-k weights are renormalized to sum 1)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the language-model loss."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE): the mean over non-padding tokens of logsumexp(router logits)^2,
    added to the auxiliary loss; it keeps the router logits small."""
    n_expert_groups: int = 1
    """Group-limited routing (DeepSeek-V2/V3): the experts split into this many equal groups of consecutive
    ids; 1 routes over all experts."""
    topk_groups: int = 1
    """Groups each token may use under group-limited routing: those with the highest group score (the
    largest expert score in the group); at most `n_expert_groups`."""
    router_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): >0 gives every router a per-expert bias, added to the
    scores only to choose the top-k, moved by this rate towards balance after each optimizer step."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    tied_embeddings: bool = False
    """Use the token-embedding matrix as the output projection."""
    max_seq_len: int = 4096
    """Longest sequence a forward pass accepts."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization of weight matrices."""

    def __post_init__(self) -> None:
        if self.moe_ffn_dim is None:
            object.__setattr__(self, "moe_ffn_dim", self.ffn_dim)
        self._check_positive()
        self._check_heads()
        self._check_moe()

    def _check_positive(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "moe_ffn_dim",
                     "moe_layer_freq", "max_seq_len", "rope_theta", "norm_eps", "init_std"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        for name in ("n_expert_groups", "topk_groups"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be positive")
        for name in ("n_experts", "n_shared_experts", "aux_loss_coef", "router_z_loss_coef", "router_bias_rate"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be non-negative")

    def _check_heads(self) -> None:
        _require(self.dim % self.n_heads == 0, "n_heads", self.n_heads,
                 f"dim {self.dim} is not divisible by n_heads")
        _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", self.n_kv_heads,
                 f"n_heads {self.n_heads} is not divisible by n_kv_heads")
        _require(self.head_dim % 2 == 0, "n_heads", self.n_heads,
                 f"head_dim = dim {self.dim} / n_heads = {self.head_dim} must be even for rotary embeddings")

    def _check_moe(self) -> None:
        _require(self.router_score in ROUTER_SCORES, "router_score", repr(self.router_score),
                 f"must be one of {', '.join(ROUTER_SCORES)}")
        if self.n_experts > 0:
            _require(0 < self.top_k <= self.n_experts, "top_k", self.top_k,
                     f"must be in 1..n_experts={self.n_experts}")
            self._check_groups()
        else:
            # Shared experts live inside MoE layers; with no MoE layer they would be silently dropped.
            _require(self.n_shared_experts == 0, "n_shared_experts", self.n_shared_experts,
                     "requires n_experts > 0")

    def _check_groups(self) -> None:
        groups = self.n_expert_groups
        _require(self.n_experts % groups == 0, "n_expert_groups", groups,
                 f"n_experts {self.n_experts} is not divisible by n_expert_groups")
        _require(self.topk_groups <= groups, "topk_groups", self.topk_groups,
                 f"must be in 1..n_expert_groups={groups}")
        reachable = self.topk_groups * (self.n_experts // groups)
        _require(self.top_k <= reachable, "top_k", self.top_k,
                 f"must be at most topk_groups * experts per group = {reachable}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def shared_ffn_dim(self) -> int:
        """Width of the fused shared-expert SwiGLU (0 without shared experts)."""
        return self.n_shared_experts * self.moe_ffn_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block `layer_idx` (0-based) uses an MoE feed-forward."""
        return self.n_experts > 0 and (layer_idx + 1) % self.moe_layer_freq == 0


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{field}={value}: {rule}")


MODEL_PRESETS: dict[str, ModelConfig] = {
    # ~0.13M parameters: unit tests and laptop smoke runs.
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192,
                        max_seq_len=1024),
    # ~0.2M parameters: every MoE feature (routed + shared experts) at test size.
    "tiny-moe": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192,
                            n_experts=4, top_k=2, moe_ffn_dim=64, n_shared_experts=1, max_seq_len=1024),
    # ~4.4M parameters: the byte-level trainer's default on local CPU ranks.
    "small-moe": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=512,
                             n_experts=8, top_k=2, moe_ffn_dim=128, n_shared_experts=1, max_seq_len=2048),
}


def model_preset(name: str) -> ModelConfig:
    """The preset called `name`; ConfigError listing the known names otherwise."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model={name!r}: unknown preset; known: {', '.join(sorted(MODEL_PRESETS))}")
    return MODEL_PRESETS[name]
