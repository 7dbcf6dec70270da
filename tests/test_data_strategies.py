"""The seams of data parallelism: one strategy per `ParallelConfig`, chosen once behind one interface, and the
parallel model that `parallelize` returns, which the pipeline executor and the trainer talk to."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import orangetron as ot
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import DataParallel, ParallelConfig, ParallelModel, parallelize
from orangetron.parallel.data import (
    DataParallelStrategy,
    ReplicatedStrategy,
    ShardedStrategy,
    Zero3Strategy,
    strategy_for,
)
from orangetron.parallel.pipeline import MicroBatch, run_pipeline
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

CFG = ModelConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
SEQ, ROWS, LR = 8, 4, 3e-2
CHOICES = {  # ParallelConfig options -> the strategy they ask for
    "ddp": (dict(zero_stage=0), ReplicatedStrategy),
    "ddp_buckets": (dict(grad_bucket_numel=100), ReplicatedStrategy),
    "zero1": (dict(zero_stage=1), ShardedStrategy),
    "zero2": (dict(zero_stage=2), ShardedStrategy),
    "zero2_buckets": (dict(zero_stage=2, grad_bucket_numel=100), ShardedStrategy),
    "distopt": (dict(distributed_optimizer=True), ShardedStrategy),
    "distopt_zero1": (dict(zero_stage=1, distributed_optimizer=True), ShardedStrategy),
    "zero3": (dict(zero_stage=3), Zero3Strategy),
    "zero3_every_microbatch": (dict(zero_stage=3, zero3_reduce_every_microbatch=True), Zero3Strategy),
}


def batch(step: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("name", CHOICES)
def test_each_parallel_config_picks_its_strategy(name):
    options, expected = CHOICES[name]
    assert strategy_for(ParallelConfig(**options)) is expected


def test_every_strategy_implements_the_whole_interface():
    for strategy in (ReplicatedStrategy, ShardedStrategy, Zero3Strategy):
        assert issubclass(strategy, DataParallelStrategy) and not inspect.isabstract(strategy), strategy


def test_the_stable_names_are_the_parallel_model():
    assert DataParallel is ParallelModel
    assert ot.DataParallel is ParallelModel and ot.ParallelModel is ParallelModel


def built_strategies() -> dict[str, str]:
    """The strategy each configuration's parallel model holds, built directly and through `parallelize`."""
    mesh = init_mesh(Layout(dp=2))
    out = {}
    for name, (options, _) in CHOICES.items():
        config = ParallelConfig(param_dtype="float64", **options)
        direct = ParallelModel(Transformer(CFG, seed=0, dtype=torch.float64), mesh, config)
        applied = parallelize(Transformer(CFG, seed=0, dtype=torch.float64), mesh, config)
        assert isinstance(applied, ParallelModel) and applied.pipeline_chunks is None
        out[name] = (type(direct.strategy).__name__, type(applied.strategy).__name__)
    return out


def test_the_parallel_model_holds_the_strategy_its_config_names():
    expected = {name: (cls.__name__, cls.__name__) for name, (_, cls) in CHOICES.items()}
    assert run_distributed(built_strategies, 2) == [expected] * 2


def parameters_after_a_step() -> dict[str, tuple[bool, bool]]:
    """Per strategy, whether the module's parameters equal the updated main parameters right after one step
    and after the next (evaluation) forward."""
    mesh = init_mesh(Layout(dp=2))
    g = mesh["dp_cp"]
    out = {}
    for name in ("ddp", "zero1", "zero2_buckets", "distopt"):
        model = ParallelModel(Transformer(CFG, seed=0, dtype=torch.float64), mesh,
                              ParallelConfig(param_dtype="float64", **CHOICES[name][0]))
        opt = model.optimizer(lr=LR)
        rows = batch()[g.rank * 2:(g.rank + 1) * 2]
        F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten()).backward()
        opt.step()
        updated = model.full_state(opt)["params"]

        def current(model: ParallelModel = model, updated: dict = updated) -> bool:
            return all(torch.equal(p, updated[n]) for n, p in model.module.named_parameters())

        after_step = current()
        with torch.no_grad():
            model(rows[:, :-1])
        out[name] = (after_step, current())
    return out


def test_sharded_parameters_are_gathered_eagerly_or_before_the_next_forward():
    """The distributed optimizer gathers right after the step, ZeRO-1/2 before the next forward, DDP never
    needs to (every rank updated the whole buffer)."""
    expected = {"ddp": (True, True), "zero1": (False, True), "zero2_buckets": (False, True),
                "distopt": (True, True)}
    assert run_distributed(parameters_after_a_step, 2) == [expected] * 2


def pipeline_from_the_parallel_model() -> dict:
    """One 1f1b step of two micro-batches on pp=2, the executor given only the parallel model."""
    mesh = init_mesh(Layout(pp=2))
    config = ParallelConfig(param_dtype="float64", pp_schedule="1f1b", microbatches=2)
    model = parallelize(Transformer(CFG, seed=0, dtype=torch.float64), mesh, config)
    tokens = batch()
    mbs = [MicroBatch(x, y, torch.arange(SEQ), None, 1 / 2, 1 / 2)
           for x, y in zip(tokens[:, :-1].chunk(2), tokens[:, 1:].chunk(2), strict=True)]
    loss = run_pipeline(model, mbs, config.pp_schedule)
    model.reduce_gradients()
    return {"chunks": [(c.stage, c.layers, c.first, c.last) for c in model.pipeline_chunks],
            "module_holds_chunks": hasattr(model.module, "pipeline_chunks"), "loss": loss,
            "grads": model.full_grads()}


def test_the_executor_runs_the_chunks_the_parallel_model_holds():
    reference = Transformer(CFG, seed=0, dtype=torch.float64)
    tokens = batch()
    loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    first, last = run_distributed(pipeline_from_the_parallel_model, 2)
    assert first["chunks"] == [(0, (0, 1), True, False)] and last["chunks"] == [(1, (2, 3), False, True)]
    assert not first["module_holds_chunks"] and not last["module_holds_chunks"]  # a field of the model object
    assert first["loss"] is None
    assert last["loss"] == pytest.approx(loss.item(), rel=1e-9)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(first["grads"][name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(last["grads"][name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_the_executor_refuses_a_model_without_pipeline_chunks():
    unpipelined = SimpleNamespace(mesh={"pp": None}, pipeline_chunks=None)
    with pytest.raises(ValueError, match="holds no pipeline chunks; parallelize it over pp > 1"):
        run_pipeline(unpipelined, [], "1f1b")
