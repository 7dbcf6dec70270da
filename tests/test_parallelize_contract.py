"""The model contract (orangetron/parallel/contract.py) and the one mechanism every dimension uses (replace.py).

The reference `Transformer` satisfies the contract before and after `parallelize`; a model that lacks a member
is refused on entry with the member's name. Every dimension changes the model only by `replace_module` at the
contract's seams: the root stays a `Transformer`, parameter names stay the reference's, and no module carries
an instance attribute that shadows a method of its class.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orangetron.mesh import init_mesh
from orangetron.model import CausalAttention, LocalDispatcher, ModelConfig, RouterLosses, TokenIO, Transformer
from orangetron.parallel import ModelContract, ModelContractError, ParallelConfig, parallelize, replace_module
from orangetron.parallel.contract import check_model, missing_members
from orangetron.parallel.replace import ReplaceError
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24)
MODELS = {
    "dense": ModelConfig(**BASE),
    "dense-tied": ModelConfig(**{**BASE, "tied_embeddings": True}),
    "moe-shared": ModelConfig(**BASE, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1, aux_loss_coef=0.01),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_reference_model_satisfies_the_contract(name):
    model = Transformer(MODELS[name])
    assert isinstance(model, ModelContract)
    assert missing_members(model) == []
    check_model(model)


def test_a_model_without_a_seam_is_refused_on_entry_naming_it():
    model = Transformer(MODELS["moe-shared"])
    del model.io
    del model.layers[1].attention.core_attention
    del model.layers[0].feed_forward.dispatcher
    with pytest.raises(ModelContractError, match=r"lacks io, layers\.0\.feed_forward\.dispatcher, "
                                                 r"layers\.1\.attention\.core_attention \("):
        parallelize(model, mesh=None)  # refused before the mesh is touched
    with pytest.raises(ModelContractError, match=r"lacks \(an nn.Module\), cfg, tok_embeddings"):
        check_model(object())
    other_io = Transformer(MODELS["dense"])
    other_io.io = nn.Identity()
    assert missing_members(other_io) == ["io.routing_mask", "io.hidden_len", "io.logits", "io.cross_entropy"]


def test_replace_module_puts_a_module_at_a_path_and_returns_the_old_one():
    model = Transformer(MODELS["dense-tied"])
    old = model.layers[1].attention.core_attention
    new = CausalAttention("reference")
    assert replace_module(model, "layers.1.attention.core_attention", new) is old
    assert model.layers[1].attention.core_attention is new and model.layers[1].attention.kernel_impl == "reference"
    norm = model.norm
    assert replace_module(model, "norm", None) is norm and model.norm is None
    assert replace_module(model, "norm", norm) is None and model.norm is norm  # an emptied slot fills again
    assert replace_module(model, "output", nn.Identity()) is None  # a tied model's output slot holds None
    for path, why in [("layers.5.attention", "layers"), ("layers.0.nothing", "no submodule 'nothing'"),
                      ("layers.0.attention.head_dim", "holds a int"), ("io.forward", "holds a method")]:
        with pytest.raises(ReplaceError, match=why):
            replace_module(model, path, nn.Identity())


def test_the_reference_seams_are_the_single_device_modules():
    model = Transformer(MODELS["moe-shared"])
    assert type(model.io) is TokenIO
    assert all(type(block.attention.core_attention) is CausalAttention for block in model.layers)
    assert all(type(block.feed_forward.dispatcher) is LocalDispatcher for block in model.layers)
    assert all(type(block.feed_forward.router.aux_losses) is RouterLosses for block in model.layers)


def _seams_after_parallelize(name: str, layout: Layout, options: dict) -> dict:
    model = Transformer(MODELS[name], seed=0, dtype=torch.float64)
    reference_names = [n for n, _ in model.named_parameters()]
    dp = parallelize(model, init_mesh(layout), ParallelConfig(param_dtype="float64", **options))
    root = dp.module
    shadowed = [f"{name}.{attr}" for name, m in root.named_modules() for attr, value in vars(m).items()
                if callable(value) and not isinstance(value, nn.Module) and hasattr(type(m), attr)]
    names = {n for n, _ in root.named_parameters()}
    return {
        "root": type(root).__name__, "same_object": root is model, "missing": missing_members(root),
        "shadowed": shadowed, "names_kept": names <= set(reference_names), "names": sorted(names),
        "types": {n: type(m).__name__ for n, m in root.named_modules()},
    }


CASES = [
    ("moe-shared", Layout(tp=2), {"sequence_parallel": True}),
    ("moe-shared", Layout(cp=2, ep=2), {"cp_mode": "ulysses"}),
    ("dense", Layout(pp=2), {"microbatches": 2}),
    ("dense-tied", Layout(dp=2), {"zero_stage": 3}),
]


def _all_cases() -> list[dict]:
    return [_seams_after_parallelize(name, layout, options) for name, layout, options in CASES]


def test_every_dimension_keeps_the_root_and_replaces_only_seams():
    results = run_distributed(_all_cases, 2)
    for rank, per_case in enumerate(results):
        for (name, layout, options), seen in zip(CASES, per_case, strict=True):
            where = f"{name} {layout} {options} rank {rank}"
            assert seen["root"] == "Transformer" and seen["same_object"], where
            assert seen["missing"] == [] and seen["shadowed"] == [], where
            assert seen["names_kept"], where
            types = seen["types"]
            if layout.tp > 1:
                assert types["io"] == "TensorParallelIO" and types["tok_embeddings"] == "VocabParallelEmbedding"
                assert types["layers.0.attention"] == "ParallelAttention", where
                assert types["layers.0.attention.core_attention"] == "CausalAttention", where
                assert types["layers.0.feed_forward.shared_expert"] == "ParallelSwiGLU", where
                assert types["layers.0.feed_forward.router.aux_losses"] == "GlobalRouterLosses", where
            if layout.cp > 1:
                assert types["layers.1.attention.core_attention"] == "ContextParallelAttention", where
            if layout.ep > 1:
                assert types["layers.0.feed_forward.dispatcher"] == "Dispatcher", where
                assert types["layers.0.feed_forward.router.aux_losses"] == "GlobalRouterLosses", where
            if layout.pp > 1:
                assert types["layers"] == "ModuleDict" and list(types).count("layers.0") == (rank == 0), where
                assert ("tok_embeddings" in types) == (rank == 0) and ("norm" in types) == (rank == 1), where
            if layout == Layout(dp=2):
                assert types["io"] == "TokenIO" and types["layers.0.feed_forward"] == "SwiGLU", where


def _misuse_on_tp2() -> list[str]:
    """What each misuse of the library raises on a tp 2 rank ('' where nothing was raised)."""
    from orangetron.spec.layout import LayoutError
    from orangetron.spec.parallel_config import ParallelConfigError

    mesh = init_mesh(Layout(tp=2))
    caught = []

    def attempt(action) -> None:
        try:
            action()
            caught.append("")
        except (ParallelConfigError, IndexError, LayoutError) as err:
            caught.append(f"{type(err).__name__}: {err}")

    model = Transformer(MODELS["dense"], seed=0)
    parallel = parallelize(model, mesh, ParallelConfig(sequence_parallel=True))
    attempt(lambda: parallelize(model, mesh, ParallelConfig(sequence_parallel=True)))  # shards the shards
    attempt(lambda: parallelize(Transformer(MODELS["dense"], seed=0, dtype=torch.float64), mesh))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    attempt(lambda: parallel(tokens.masked_fill(tokens == tokens[0, 3], 40)))  # one rank: IndexError
    logits = parallel(tokens)
    attempt(lambda: parallel.module.loss_from_logits(logits, tokens.masked_fill(tokens == tokens[0, 3], 999)))
    attempt(lambda: parallel.module.loss_from_logits(logits, tokens.masked_fill(tokens == tokens[0, 3], -100)))
    # A layout refused before any change leaves the model fresh: the corrected call goes through.
    staged, pp = Transformer(MODELS["dense"], seed=0), init_mesh(Layout(pp=2))
    attempt(lambda: parallelize(staged, pp, ParallelConfig(pp_schedule="interleaved", virtual_stages=3,
                                                           microbatches=2)))
    attempt(lambda: parallelize(staged, pp, ParallelConfig(microbatches=2)))
    return caught


def test_misuse_that_one_rank_refuses_is_refused_on_tp_ranks_too():
    """A trial of the library found three silent misuses: a model parallelized twice (the second pass sharded the
    shards, breaking both), a float64 model rounded to the default float32 unsaid, and under tp a token id or
    label past the vocabulary, which every rank found off its own slice (finite logits, a loss of 5.5) where one
    rank raises IndexError."""
    for caught in run_distributed(_misuse_on_tp2, 2):
        assert caught[0].startswith("ParallelConfigError: this model was parallelized already"), caught[0]
        assert caught[1].startswith("ParallelConfigError: param_dtype='float32': the model's parameters are "
                                    "float64"), caught[1]
        assert caught[2] == "IndexError: token id 40 lies outside the vocabulary [0, 32)"
        assert caught[3] == "IndexError: label 999 lies outside the vocabulary [0, 32)"
        assert caught[4] == ""  # the ignored label
        assert caught[5].startswith("LayoutError") and caught[6] == "", caught[5:]
