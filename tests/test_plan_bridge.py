"""The cost model reads the runtime's own objects (ModelConfig, Layout, ParallelConfig) and predicts exactly
what the runtime measures: parameter counts of the reference model, and, for every data-parallel stage the
runtime runs today (DDP, ZeRO-1/2/3, distributed optimizer), the ledger's CommRecords and the model-state
bytes by category. TP, CP, EP and PP join this table when the runtime has them.
"""

import pytest

from orangetron import model as model_mod
from orangetron.parallel import ParallelConfig
from orangetron.plan.bridge import degrees_from_layout, predicted_step
from orangetron.plan.traffic import data_parallel_records
from orangetron.spec.collectives import OPS
from orangetron.spec.layout import Layout
from orangetron.spec.options import Job
from orangetron.spec.parallel_config import values_of
from orangetron.testing import run_distributed


def _config(**overrides):
    base = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96)
    base.update(overrides)
    return model_mod.ModelConfig(**base)


@pytest.mark.parametrize("overrides", [
    {},
    {"tied_embeddings": True},
    {"n_experts": 4, "top_k": 2, "moe_ffn_dim": 48},
    {"n_experts": 4, "top_k": 1, "moe_ffn_dim": 32, "n_shared_experts": 1, "moe_layer_freq": 2},
])
def test_param_count_equals_reference_model(overrides):
    cfg = _config(**overrides)
    measured = sum(p.numel() for p in model_mod.Transformer(cfg).parameters())
    assert cfg.total_params() == measured


def test_predicted_step_from_runtime_objects():
    cfg = _config(n_experts=4, top_k=2, moe_ffn_dim=48)
    layout = Layout(tp=2, dp=2, ep=2)
    pc = ParallelConfig(zero_stage=1, param_dtype="float32", microbatches=2, sequence_parallel=True)
    assert degrees_from_layout(layout).world_size == layout.world_size
    job = Job(**values_of(ParallelConfig, pc), seq_len=32, micro_batch=2)  # the runtime's options, priced
    assert job.replica_microbatches(degrees_from_layout(layout)) == 2
    records, memory = predicted_step(cfg, layout, pc, seq_len=32, micro_batch=2)
    assert {r.op for r in records} <= set(OPS)
    assert {"all_to_all/ep", "all_gather/tp", "reduce_scatter/dp_cp"} <= {r.key for r in records}
    assert memory["main_params"] == 0  # float32 params keep no separate main copy
    assert memory["params"] > 0 and memory["activations"] > 0


# ---- planner == ledger, for what the runtime can run today (data parallelism) ------------------------
STAGES = {"ddp": dict(zero_stage=0), "ddp_buckets": dict(grad_bucket_numel=3000), "zero1": dict(zero_stage=1),
          "distopt": dict(distributed_optimizer=True),
          "zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
          "zero1_buckets": dict(zero_stage=1, grad_bucket_numel=3000),
          "zero2_buckets": dict(zero_stage=2, grad_bucket_numel=3000),
          "distopt_buckets": dict(distributed_optimizer=True, grad_bucket_numel=3000)}


def _measured_dp_steps(world: int, param_dtype: str):
    """On each rank: two steps of every ZeRO stage; the second step's ledger and the model-state memory."""
    import torch

    from orangetron import comm, memory
    from orangetron.mesh import init_mesh
    from orangetron.parallel import DataParallel, ParallelConfig
    from orangetron.spec.layout import Layout

    cfg = _config(n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1)
    mesh = init_mesh(Layout(dp=world))
    out = {}
    for stage, opts in STAGES.items():
        pc = ParallelConfig(param_dtype=param_dtype, **opts)
        dp = DataParallel(model_mod.Transformer(cfg, seed=0, dtype=torch.float32), mesh, pc)
        opt = dp.optimizer(lr=1e-3)
        for step in range(2):
            tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
            with comm.measure() as records:
                loss = dp(tokens[:, :-1]).float().logsumexp(-1).mean()
                loss.backward()
                opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        out[stage] = (sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records),
                      memory.model_state_bytes(dp, opt))
    return out


@pytest.mark.parametrize("world, param_dtype", [(2, "float64"), (4, "float32"), (4, "bfloat16")])
def test_planner_equals_runtime_ledger_and_memory_for_data_parallel(world, param_dtype):
    """Every ZeRO stage: predicted CommRecords and model-state bytes equal the measured ones on every rank."""
    measured = run_distributed(_measured_dp_steps, world, args=(world, param_dtype))
    cfg = _config(n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1)
    for stage, opts in STAGES.items():
        pc = ParallelConfig(param_dtype=param_dtype, **opts)
        _, mem = predicted_step(cfg, Layout(dp=world), pc, seq_len=16, micro_batch=2)
        # The measured loop clips gradients with the sharded norm, so the prediction does too.
        job = Job(**values_of(ParallelConfig, pc), seq_len=16, micro_batch=2, clip_grad=True)
        predicted = data_parallel_records(cfg, degrees_from_layout(Layout(dp=world)), job)
        want = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in predicted)
        assert want, "the prediction must not be empty"
        for rank, per_rank in enumerate(measured):
            got_records, got_state = per_rank[stage]
            assert got_records == want, f"{stage} rank {rank}"
            assert got_state == {k: mem[k] for k in got_state}, f"{stage} rank {rank}"


@pytest.mark.parametrize("dtype, zero_stage", [("float32", 0), ("bfloat16", 0), ("bfloat16", 3), ("float64", 1)])
def test_train_json_memory_equals_the_cost_model(dtype, zero_stage):
    """`orangetron train --json` reports what `estimate` predicts, category by category (one rank)."""
    from orangetron.train.trainer import TrainConfig, train

    cfg = TrainConfig(model="tiny-moe", steps=1, seq_len=32, batch_size=4, corpus_bytes=200_000, param_dtype=dtype,
                      zero_stage=zero_stage)
    [measured] = train(cfg, progress=False)["memory"]
    _, predicted = predicted_step(cfg.model_config(), cfg.layout, cfg.parallel_config(), seq_len=32, micro_batch=4)
    assert measured["activations_peak"] == predicted["activations"]
    assert {k: measured[k] for k in ("params", "grads", "main_params", "optimizer")} == {
        k: predicted[k] for k in ("params", "grads", "main_params", "optimizer")}


def test_runtime_prediction_uses_one_gradient_bucket_at_any_size():
    """The runtime reduces the whole flat buffer at once, so a 200M-parameter model gets one record too."""
    big = _config(dim=2048, n_layers=4, n_heads=16, n_kv_heads=16, vocab_size=32000, ffn_dim=8192)
    assert big.total_params() > 50_000_000
    for stage in ("zero1", "ddp"):
        records, _ = predicted_step(big, Layout(dp=3), ParallelConfig(**STAGES[stage]), seq_len=16, micro_batch=1)
        reductions = [r for r in records if r.op in ("reduce_scatter", "all_reduce")]
        assert len(reductions) == 1, stage
