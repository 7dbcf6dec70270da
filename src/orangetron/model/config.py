"""The runtime's side of the one model schema (`ModelSpec`, spec/model.py): the `ModelConfig` builder with the
runtime's argument names and defaults, what the reference model can build (`check_runnable`), the presets
`train` builds, and the model a checkpoint records. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping

from orangetron.spec.model import RUNTIME_NAMES, ModelSpec, in_runtime_names, load_decoder
from orangetron.spec.model_rules import ConfigError

__all__ = ["MODEL_PRESETS", "ConfigError", "ModelConfig", "ModelSpec", "check_runnable", "model_from_record",
           "model_preset"]


def ModelConfig(  # noqa: N802 (the stable name users call, from when it was a class)
    dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int, ffn_dim: int,
    n_experts: int = 0, top_k: int = 2, moe_ffn_dim: int | None = None, n_shared_experts: int = 0,
    moe_layer_freq: int = 1, router_score: str = "softmax", norm_topk_prob: bool = False, aux_loss_coef: float = 0.01,
    router_z_loss_coef: float = 0.0, n_expert_groups: int = 1, topk_groups: int = 1,
    router_bias_rate: float = 0.0, routed_scaling_factor: float = 1.0, group_score: str = "max",
    shared_expert_gate: bool = False, rope_theta: float = 10000.0, norm_eps: float = 1e-5,
    tied_embeddings: bool = False, max_seq_len: int = 4096, init_std: float = 0.02, name: str = "custom",
) -> ModelSpec:
    """A Llama-style decoder (RMSNorm, rotary GQA attention, SwiGLU, optional MoE layers) as a `ModelSpec`,
    from the runtime's argument names (`RUNTIME_NAMES`); each argument means what its schema field does.

    The runtime's defaults: `top_k=2`, `aux_loss_coef=0.01`, `moe_ffn_dim=None` meaning `ffn_dim`. A dense model
    (`n_experts=0`) stores its routing-only arguments as the schema's zeros, so it equals the same model
    written with schema names. Errors (`ConfigError`) name the arguments as given here; what the runtime
    cannot build is refused too (`check_runnable`).
    """
    arguments = dict(locals())  # the arguments above, by name, before anything else is bound here
    if moe_ffn_dim is None:
        arguments["moe_ffn_dim"] = ffn_dim
    if not n_experts:
        arguments.update(top_k=0, moe_ffn_dim=0, norm_topk_prob=False, aux_loss_coef=0.0, router_z_loss_coef=0.0,
                         router_bias_rate=0.0, routed_scaling_factor=1.0, group_score="max")
    try:
        spec = ModelSpec(**{RUNTIME_NAMES.get(key, key): value for key, value in arguments.items()})
        check_runnable(spec)
    except ConfigError as err:
        raise in_runtime_names(err) from None
    return spec


def check_runnable(spec: ModelSpec) -> None:
    """Raise `ConfigError("field=value: reason")` for the first field the reference model cannot build yet;
    the planner prices such specs all the same."""
    for field, runnable, reason in _runtime_limits(spec):
        if not runnable:
            raise ConfigError(f"{field}={getattr(spec, field)!r}: {reason}")


def _runtime_limits(spec: ModelSpec) -> list[tuple[str, bool, str]]:
    """(field, whether the runtime builds its value, why not) for each field the runtime does not cover."""
    planner_only = "the planner prices it, the runtime does not build it yet"
    return [
        ("mlp", spec.mlp == "swiglu", f"the runtime builds SwiGLU MLPs only; {planner_only}"),
        ("bias", not spec.bias, f"the runtime builds bias-free layers with RMSNorm; {planner_only}"),
        ("max_position_embeddings", spec.max_position_embeddings == 0,
         f"learned positions: the runtime uses rotary embeddings; {planner_only}"),
        ("q_lora_rank", spec.q_lora_rank == 0, f"multi-head latent attention: {planner_only}"),
        ("kv_lora_rank", spec.kv_lora_rank == 0, f"multi-head latent attention: {planner_only}"),
        ("qk_rope_head_dim", spec.qk_rope_head_dim == 0, f"multi-head latent attention: {planner_only}"),
        ("v_head_dim", spec.v_head_dim == 0, f"multi-head latent attention: {planner_only}"),
        ("mtp_layers", spec.mtp_layers == 0, f"multi-token prediction: {planner_only}"),
        ("patch_size", spec.patch_size == 0, f"a vision tower's patch embedding: {planner_only}"),
        ("causal", spec.causal, f"bidirectional attention: {planner_only}"),
        ("dropout", spec.dropout == 0, f"the runtime has no dropout; {planner_only}"),
        ("seq_len", spec.seq_len == 0, "a tower's tokens per sample; a run's sequence length is its own option"),
        ("vocab_size", spec.vocab_size > 0, "the runtime's decoders need a token vocabulary"),
        ("head_dim", spec.head_dim % 2 == 0, "must be even for rotary embeddings"),
    ]


def model_from_record(record: Mapping[str, object]) -> ModelSpec:
    """The model a checkpoint recorded (`dataclasses.asdict` of it): a `ModelSpec`'s fields, or the runtime's
    argument names that checkpoints stored before the one schema (`dim`, `n_layers`, ...; no `name`).

    Records from before `routed_scaling_factor` existed come from when sigmoid routers always renormalized
    their top-k weights whatever `norm_topk_prob` said, so such a sigmoid record reads with it true."""
    if "routed_scaling_factor" not in record and record.get("router_score") == "sigmoid":
        record = {**record, "norm_topk_prob": True}
    if "hidden_size" in record:
        return ModelSpec(**record)
    return ModelConfig(**record)


# The models `train` builds by name: files in the one schema, shipped beside the planner's presets
# (spec/presets/models/), so `estimate --model tiny-moe` prices the very model `train --model tiny-moe` runs.
TRAIN_PRESETS = ("tiny", "tiny-moe", "small-moe")
MODEL_PRESETS: dict[str, ModelSpec] = {name: load_decoder(name) for name in TRAIN_PRESETS}


def model_preset(name: str) -> ModelSpec:
    """The preset called `name`; ConfigError listing the known names otherwise."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model={name!r}: unknown preset; known: {', '.join(sorted(MODEL_PRESETS))}")
    return MODEL_PRESETS[name]
