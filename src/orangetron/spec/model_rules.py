"""The rules every model description keeps, runtime and planner alike, raised as `ConfigError`.

`ModelSpec.__post_init__` (spec/model.py) runs `check_model` on the fields as given, before it resolves the
zeros that stand for derived values. What only the runtime cannot build yet (latent attention, learned
positions, ...) is not a rule of the schema: `orangetron.model.config.check_runnable` refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orangetron.spec.model import ModelSpec

MLP_KINDS = ("swiglu", "gelu")
ROUTER_SCORES = ("softmax", "sigmoid")
ROPE_SCALINGS = ("none", "llama3")
GROUP_SCORES = ("max", "top2_sum")

_POSITIVE = ("hidden_size", "num_layers", "num_heads", "moe_layer_freq", "max_seq_len", "rope_theta", "norm_eps",
             "init_std", "routed_scaling_factor", "rope_scaling_factor", "rope_low_freq_factor",
             "rope_high_freq_factor", "rope_original_max_positions")
_NON_NEGATIVE = ("vocab_size", "ffn_hidden_size", "num_kv_heads", "head_dim", "num_experts", "top_k",
                 "moe_ffn_hidden_size", "num_shared_experts", "first_dense_layers", "max_position_embeddings",
                 "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "patch_size", "seq_len",
                 "expert_groups", "groups_per_token", "mtp_layers", "dropout", "aux_loss_coef",
                 "router_z_loss_coef", "router_bias_rate")


class ConfigError(ValueError):
    """A model description breaks a rule; the message reads `field=value: rule`."""


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    """Raise `ConfigError("field=value: rule")` unless `ok` (strings shown quoted)."""
    if not ok:
        raise ConfigError(f"{field}={value!r}: {rule}")


def check_model(spec: ModelSpec) -> None:
    """Raise `ConfigError` for the first rule `spec` breaks."""
    _check_signs(spec)
    _require(spec.mlp in MLP_KINDS, "mlp", spec.mlp, f"must be one of {', '.join(MLP_KINDS)}")
    _require(spec.router_score in ROUTER_SCORES, "router_score", spec.router_score,
            f"must be one of {', '.join(ROUTER_SCORES)}")
    _require(spec.dropout < 1, "dropout", spec.dropout, "must be below 1")
    _check_rope_scaling(spec)
    _check_heads(spec)
    _check_experts(spec)
    _check_groups(spec)
    _check_dense_width(spec)


def _check_signs(spec: ModelSpec) -> None:
    for name in _POSITIVE:
        _require(getattr(spec, name) > 0, name, getattr(spec, name), "must be positive")
    for name in _NON_NEGATIVE:
        _require(getattr(spec, name) >= 0, name, getattr(spec, name), "must be non-negative")


def _check_rope_scaling(spec: ModelSpec) -> None:
    _require(spec.rope_scaling in ROPE_SCALINGS, "rope_scaling", spec.rope_scaling,
             f"must be one of {', '.join(ROPE_SCALINGS)}")
    if spec.rope_scaling == "llama3":
        _require(spec.rope_high_freq_factor > spec.rope_low_freq_factor, "rope_high_freq_factor",
                 spec.rope_high_freq_factor, f"must exceed rope_low_freq_factor={spec.rope_low_freq_factor}")


def _check_heads(spec: ModelSpec) -> None:
    if not spec.head_dim:  # derived from the width, which must then split evenly
        _require(spec.hidden_size % spec.num_heads == 0, "num_heads", spec.num_heads,
                f"hidden_size {spec.hidden_size} is not divisible by num_heads")
    kv_heads = spec.num_kv_heads or spec.num_heads
    _require(spec.num_heads % kv_heads == 0, "num_kv_heads", kv_heads,
            f"num_heads {spec.num_heads} is not divisible by num_kv_heads")


def _check_experts(spec: ModelSpec) -> None:
    if spec.num_experts:
        _require(0 < spec.top_k <= spec.num_experts, "top_k", spec.top_k,
                f"must be in 1..num_experts={spec.num_experts}")
        _require(spec.moe_ffn_hidden_size > 0, "moe_ffn_hidden_size", spec.moe_ffn_hidden_size,
                "must be positive for a MoE model")
    else:
        # Shared experts live inside MoE layers; with none they, and a routing width, would be dropped without a
        # word.
        _require(spec.num_shared_experts == 0, "num_shared_experts", spec.num_shared_experts,
                "requires num_experts > 0")
        _require(spec.top_k == 0, "top_k", spec.top_k, "requires num_experts > 0 (a model without experts routes "
                 "nothing)")
    if spec.shared_expert_gate:
        _require(spec.num_shared_experts > 0, "shared_expert_gate", True, "requires num_shared_experts > 0")


def _check_groups(spec: ModelSpec) -> None:
    """Group-limited routing: equal groups of the experts, a token's top_k experts from groups_per_token of
    them. 0 or 1 in both fields is one group: no limit."""
    groups, per_token = spec.expert_groups, spec.groups_per_token
    _require(spec.group_score in GROUP_SCORES, "group_score", spec.group_score,
             f"must be one of {', '.join(GROUP_SCORES)}")
    if groups <= 1 and per_token <= 1:
        return
    _require(spec.num_experts > 0, "expert_groups", groups, "requires num_experts > 0")
    if groups:
        _require(spec.num_experts % groups == 0, "expert_groups", groups,
                f"num_experts {spec.num_experts} is not divisible by expert_groups")
    _require(0 < per_token <= groups, "groups_per_token", per_token, f"must be in 1..expert_groups={groups}")
    if spec.group_score == "top2_sum":
        _require(spec.num_experts >= 2 * groups, "group_score", spec.group_score,
                 f"needs at least 2 experts per group; num_experts {spec.num_experts} / expert_groups {groups}")
    reachable = per_token * (spec.num_experts // groups)
    _require(spec.top_k <= reachable, "top_k", spec.top_k,
            f"must be at most groups_per_token * experts per group = {reachable}")


def _check_dense_width(spec: ModelSpec) -> None:
    has_dense_layer = not all(spec.is_moe_layer(i) for i in range(spec.num_layers))
    if has_dense_layer:
        _require(spec.ffn_hidden_size > 0, "ffn_hidden_size", spec.ffn_hidden_size,
                "must be positive when a layer is dense")
