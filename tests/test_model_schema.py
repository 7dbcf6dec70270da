"""The one model schema (`ModelSpec`, spec/model.py): the runtime's names read it, `ModelConfig` builds it with
the runtime's defaults, the runtime refuses what it cannot build yet in one line naming the field, and a
checkpoint's record in the old runtime names still describes the same model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orangetron.cli import main as run
from orangetron.model import (
    MODEL_PRESETS,
    ConfigError,
    ModelConfig,
    SwiGLU,
    Transformer,
    check_runnable,
    model_from_record,
    model_preset,
)
from orangetron.model.moe import MoE
from orangetron.spec.model import RUNTIME_NAMES, ModelSpec, load_decoder
from orangetron.train.config import TrainConfig, TrainConfigError

torch.set_num_threads(1)

TINY_MOE = model_preset("tiny-moe")
RUNNABLE = ModelSpec(name="runnable", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64,
                     ffn_hidden_size=48)


def test_runtime_names_read_the_schema_fields():
    for spec in MODEL_PRESETS.values():
        for runtime_name, schema_name in RUNTIME_NAMES.items():
            assert getattr(spec, runtime_name) == getattr(spec, schema_name), runtime_name
    assert TINY_MOE.dim == 64 and TINY_MOE.n_layers == 2 and TINY_MOE.head_dim == 16
    assert TINY_MOE.shared_ffn_dim == 64 and TINY_MOE.n_expert_groups == 1
    with pytest.raises(AttributeError):
        TINY_MOE.dim = 32  # read-only


def test_model_config_is_the_schema_with_the_runtime_defaults():
    moe = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, n_experts=4)
    assert moe == ModelSpec(name="custom", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64,
                            ffn_hidden_size=48, num_experts=4, top_k=2, moe_ffn_hidden_size=48, aux_loss_coef=0.01)
    dense = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, top_k=3,
                        aux_loss_coef=0.5, name="runnable")
    assert dense == RUNNABLE  # routing-only arguments of a dense model are the schema's zeros


def test_zeros_that_stand_for_derived_values_are_resolved():
    spec = ModelSpec(name="m", hidden_size=64, num_layers=1, num_heads=4, vocab_size=8, ffn_hidden_size=8)
    assert (spec.head_dim, spec.num_kv_heads, spec.expert_groups, spec.groups_per_token) == (16, 4, 1, 1)
    wider = spec.with_changes(hidden_size=128)
    assert (wider.head_dim, wider.num_kv_heads) == (32, 4)
    assert dataclasses.replace(spec, hidden_size=128).head_dim == 16  # replace keeps the resolved value
    gqa = ModelSpec(name="g", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=8,
                    ffn_hidden_size=8)
    assert (gqa.with_changes(hidden_size=128).head_dim, gqa.with_changes(num_heads=8).num_kv_heads) == (8, 2)


def test_schema_errors_name_the_schema_field_and_model_config_the_runtime_argument():
    with pytest.raises(ConfigError, match=r"^num_heads=6: hidden_size 128 is not divisible by num_heads$"):
        ModelSpec(name="m", hidden_size=128, num_layers=1, num_heads=6, vocab_size=8, ffn_hidden_size=8)
    with pytest.raises(ConfigError, match=r"^n_heads=6: dim 128 is not divisible by n_heads$"):
        ModelConfig(dim=128, n_layers=1, n_heads=6, n_kv_heads=6, vocab_size=8, ffn_dim=8)
    with pytest.raises(ConfigError, match=r"^router_bias_rate=-1.0: must be non-negative$"):
        dataclasses.replace(TINY_MOE, router_bias_rate=-1.0)


def test_router_bias_is_read_off_its_rate():
    assert not TINY_MOE.router_bias
    assert dataclasses.replace(TINY_MOE, router_bias_rate=0.01).router_bias
    assert not dataclasses.replace(RUNNABLE, router_bias_rate=0.01).router_bias  # no experts, no routers


# field -> a change the runtime cannot build; MLA's fields come one at a time, the rest of MLA left as it is
UNBUILDABLE = {
    "mlp": dict(mlp="gelu"),
    "bias": dict(bias=True),
    "max_position_embeddings": dict(max_position_embeddings=128),
    "q_lora_rank": dict(q_lora_rank=16),
    "kv_lora_rank": dict(kv_lora_rank=16),
    "qk_rope_head_dim": dict(qk_rope_head_dim=4),
    "v_head_dim": dict(v_head_dim=4),
    "mtp_layers": dict(mtp_layers=1),
    "patch_size": dict(patch_size=14),
    "causal": dict(causal=False),
    "dropout": dict(dropout=0.1),
    "seq_len": dict(seq_len=77),
    "vocab_size": dict(vocab_size=0),
    "head_dim": dict(hidden_size=12, num_heads=4, num_kv_heads=4, head_dim=0),  # head_dim 3: rotary needs even
}


@pytest.mark.parametrize("field", list(UNBUILDABLE))
def test_the_runtime_refuses_each_field_it_cannot_build_in_one_line(field):
    spec = RUNNABLE.with_changes(**UNBUILDABLE[field])
    with pytest.raises(ConfigError) as refused:
        Transformer(spec)
    line = str(refused.value)
    assert line.startswith(f"{field}=") and "\n" not in line
    with pytest.raises(TrainConfigError) as refused_run:
        TrainConfig(model=spec, seq_len=16, batch_size=2)
    assert str(refused_run.value) == f"model='runnable' (--model): {line}"


def test_the_runtime_builds_what_it_does_not_refuse():
    check_runnable(RUNNABLE)
    for spec in MODEL_PRESETS.values():
        check_runnable(spec)
    check_runnable(load_decoder("llama3-8b"))
    TrainConfig(model="llama3-8b")  # a planner preset the runtime can build: validated, not built here


def test_leading_dense_layers_are_built_dense_and_counted_as_the_planner_counts():
    spec = dataclasses.replace(TINY_MOE, num_layers=3, first_dense_layers=1)
    model = Transformer(spec)
    kinds = [type(layer.feed_forward) for layer in model.layers]
    assert kinds == [SwiGLU, MoE, MoE]
    assert sum(p.numel() for p in model.parameters()) == spec.total_params()


def test_a_planner_only_preset_prices_and_the_runtime_refuses_it(capsys):
    assert run(["estimate", "--model", "deepseek-v3", "--tp", "1", "--dp", "8", "--json"]) == 0
    capsys.readouterr()
    assert run(["train", "--model", "deepseek-v3"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("orangetron train: error: model='deepseek-v3' (--model): q_lora_rank=1536: multi-head latent "
                     "attention: the planner prices it, the runtime does not build it yet")
    with pytest.raises(TrainConfigError, match=r"model='nope' \(--model\): unknown preset"):
        TrainConfig(model="nope")


# A checkpoint written before the one schema recorded `dataclasses.asdict` of the runtime's ModelConfig.
OLD_TINY_RECORD = {
    "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 192, "n_experts": 0,
    "top_k": 2, "moe_ffn_dim": 192, "n_shared_experts": 0, "moe_layer_freq": 1, "router_score": "softmax",
    "aux_loss_coef": 0.01, "router_z_loss_coef": 0.0, "n_expert_groups": 1, "topk_groups": 1,
    "router_bias_rate": 0.0, "rope_theta": 10000.0, "norm_eps": 1e-05, "tied_embeddings": False,
    "max_seq_len": 1024, "init_std": 0.02,
}


def test_a_record_in_the_old_runtime_names_is_the_same_model():
    assert model_from_record(OLD_TINY_RECORD) == dataclasses.replace(model_preset("tiny"), name="custom")
    assert model_from_record(dataclasses.asdict(TINY_MOE)) == TINY_MOE
    with pytest.raises(ConfigError, match=r"^n_heads=3: dim 64 is not divisible by n_heads$"):
        model_from_record({**OLD_TINY_RECORD, "n_heads": 3})


def test_train_presets_are_model_files_holding_the_models_they_always_were() -> None:
    """The presets moved from Python into spec/presets/models/*.toml; each file must still build the model the
    runtime's arguments used to (written out here), and the planner must price the same file."""
    from orangetron.model.config import ModelConfig
    from orangetron.spec.model import load_model, preset_names

    moe = dict(n_experts=4, top_k=2, moe_ffn_dim=64, n_shared_experts=1)
    before = {
        "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=1024,
                            name="tiny"),
        "tiny-moe": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192,
                                max_seq_len=1024, name="tiny-moe", **moe),
        "small-moe": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=512,
                                 n_experts=8, top_k=2, moe_ffn_dim=128, n_shared_experts=1, max_seq_len=2048,
                                 name="small-moe"),
    }
    assert before == MODEL_PRESETS
    assert set(before) <= set(preset_names())
    assert all(load_model(name) == spec for name, spec in before.items())
    assert before["small-moe"].total_params() == 4_466_944


def test_qkv_bias_qk_norm_and_a_free_head_dim_are_built_counted_and_read_from_toml(tmp_path):
    """Qwen2's q/k/v biases (none on wo) and Qwen3's per-head QK-norm with head_dim 32 != 64 / 4."""
    spec = RUNNABLE.with_changes(hidden_size=64, head_dim=32, qkv_bias=True, qk_norm=True)
    model = Transformer(spec)
    attention = model.layers[0].attention
    assert attention.wq.bias.shape == (4 * 32,) and attention.wk.bias.shape == (2 * 32,) and attention.wo.bias is None
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (32,)
    assert attention.q_norm.eps == spec.norm_eps
    assert sum(p.numel() for p in model.parameters()) == spec.total_params()
    # 2 layers x (biases 4*32 + 2*2*32, QK-norm weights 2*32) over the same model without them
    plain = spec.with_changes(qkv_bias=False, qk_norm=False)
    assert spec.total_params() - plain.total_params() == 2 * (128 + 128 + 64)
    path = tmp_path / "qwen.toml"
    path.write_text("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 32\n"
                    "vocab_size = 64\nffn_hidden_size = 48\nqkv_bias = true\nqk_norm = true\n")
    assert load_decoder(str(path)) == dataclasses.replace(spec, name="qwen")
    assert model_from_record(dataclasses.asdict(spec)) == spec  # a run folder's record reads back
