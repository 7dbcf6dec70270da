"""DDP, ZeRO-1/2/3 and the distributed optimizer against one device, in float64, with ledger and memory
checked against docs/data_parallel.md's tables written out by hand."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from orangetron import comm, memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import DataParallel, ParallelConfig, ParallelConfigError
from orangetron.parallel.config import check_runnable
from orangetron.plan.bridge import predicted_step
from orangetron.spec.layout import Layout
from orangetron.spec.rules import RuleError
from orangetron.testing import run_distributed

CFG = ModelConfig(dim=18, n_layers=2, n_heads=3, n_kv_heads=1, vocab_size=32, ffn_dim=24, n_experts=4, top_k=2,
                  moe_ffn_dim=8, n_shared_experts=1, aux_loss_coef=0.0)  # local aux losses are not additive
SEQ, PER_RANK, STEPS, LR, CLIP = 8, 2, 3, 3e-2, 0.5
BUCKET = 500  # elements: buckets cross parameter boundaries, and the last one is shorter
STAGES = {"ddp": dict(zero_stage=0), "ddp_buckets": dict(grad_bucket_numel=BUCKET), "zero1": dict(zero_stage=1),
          "distopt": dict(distributed_optimizer=True), "zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
          "zero3_serial": dict(zero_stage=3, zero3_prefetch=False),
          "zero3_keep": dict(zero_stage=3, zero3_keep_params=True),
          "zero1_buckets": dict(zero_stage=1, grad_bucket_numel=BUCKET),
          "zero2_buckets": dict(zero_stage=2, grad_bucket_numel=BUCKET),
          "distopt_buckets": dict(distributed_optimizer=True, grad_bucket_numel=BUCKET)}
ZERO3 = ("zero3", "zero3_serial", "zero3_keep")
SHARDED_BUCKETS = ("zero1_buckets", "zero2_buckets", "distopt_buckets")


def batch(step: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, CFG.vocab_size, (rows, SEQ + 1), generator=g)


def ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def reference(d: int) -> tuple[list[float], torch.Tensor, list[torch.Tensor]]:
    """One device, the whole batch, torch.optim.AdamW and torch's gradient clipping.

    Returns the losses, the final parameters and every step's gradients before clipping (all flat)."""
    model = Transformer(CFG, seed=0, dtype=torch.float64)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), foreach=False)
    losses, grads = [], []
    for step in range(STEPS):
        tokens = batch(step, d * PER_RANK)
        loss = ce(model(tokens[:, :-1]), tokens)
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), grads


def data_parallel_run(layout: Layout, stage: str, param_dtype: str = "float64"):
    """STEPS steps on this rank's share of the batch; returns losses, final params, the ledger of every step,
    memory, the number of parameters and the averaged gradients this rank owns at every step."""
    mesh = init_mesh(layout)
    dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.float32}[param_dtype]
    dp = DataParallel(Transformer(CFG, seed=0, dtype=dtype), mesh, ParallelConfig(param_dtype=param_dtype,
                                                                                   **STAGES[stage]))
    opt = dp.optimizer(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g, losses, step_records, peaks, grads = mesh["dp_cp"], [], [], [], []
    for step in range(STEPS):
        rows = batch(step, g.size * PER_RANK)[g.rank * PER_RANK:(g.rank + 1) * PER_RANK]
        with comm.measure() as records, memory.track_activations(dp.module) as meter:
            loss = ce(dp(rows[:, :-1]), rows)
            loss.backward()
            dp.reduce_gradients()  # what clipping would do first; the gradients are read before they are clipped
            if dp.zero3:  # units are padded one by one: read whole tensors, in the model's order
                with comm.unmeasured():
                    whole = dp.full_grads()
                grads.append(torch.cat([whole[n].reshape(-1) for n, _ in dp.module.named_parameters()]))
            else:
                grads.append(dp.owned_grads().double().clone())
            opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        peaks.append(meter.peak_bytes)
        step_records.append([(r.op, r.dim, r.payload_bytes, r.bytes_sent) for r in records])
    state = memory.model_state_bytes(dp, opt)
    dp.gather_params()  # whole parameters to read, where the strategy shards them
    params = torch.cat([p.detach().reshape(-1).double() for p in dp.module.parameters()])
    return losses, params, step_records, state | {"activations": max(peaks)}, dp.numel, grads


LAYOUTS = [Layout(dp=2), Layout(dp=4), Layout(tp=2, dp=2)]


def all_stages(layout: Layout):
    return {stage: data_parallel_run(layout, stage) for stage in STAGES}


def full_grads(results: list[dict], stage: str, step: int, layout: Layout) -> torch.Tensor:
    """The whole averaged gradient of `step`, from the slices the dp ranks own (tp peers hold the same)."""
    if stage in ZERO3:
        return results[0][stage][5][step]
    slices = [by_stage[stage][5][step] for by_stage in results[:: layout.tp]]
    numel = results[0][stage][4]
    if stage in SHARDED_BUCKETS:  # [buckets, slice] per rank: rank r holds slice r of every bucket
        return torch.stack(slices, dim=1).reshape(-1)[:numel]
    return torch.cat(slices)[:numel] if stage not in ("ddp", "ddp_buckets") else slices[0]


def equal_buckets(numel: int, d: int) -> tuple[int, int]:
    """(count, size): as few buckets as hold numel at BUCKET rounded up to a multiple of d, equal sizes, each
    a multiple of d. Written out here, by hand, for the test model."""
    most = -(-BUCKET // d) * d
    count = -(-numel // most)
    return count, -(-numel // (count * d)) * d


def unit_numels() -> list[int]:
    """ZeRO-3's units, from the plain model: the embedding, each block, the head (final norm and output)."""
    model = Transformer(CFG, seed=0)
    return [sum(p.numel() for p in m.parameters())
            for m in (model.tok_embeddings, *model.layers, torch.nn.ModuleList([model.norm, model.output]))]


def zero3_records(stage: str, units: list[int], d: int):
    """Per unit: gathered before forward and (unless kept) before backward; reduce-scattered once."""
    padded = [-(-u // d) * d * 8 for u in units]
    ags = [("all_gather", "dp_cp", b, b * (d - 1) // d) for b in padded]
    rss = [("reduce_scatter", "dp_cp", b, b * (d - 1) // d) for b in padded]
    clip = ("all_reduce", "dp_cp", 8, 2 * 8 * (d - 1) // d)
    return sorted(ags * (1 if stage == "zero3_keep" else 2) + rss + [clip])


def expected_records(stage: str, step: int, numel: int, d: int):
    """docs/data_parallel.md's table of one step, float64 bytes, flat buffers padded to a multiple of d."""
    padded = -(-numel // d) * d * 8
    share = padded * (d - 1) // d
    if stage == "ddp":
        return [("all_reduce", "dp_cp", numel * 8, 2 * (numel * 8) * (d - 1) // d)]
    if stage == "ddp_buckets":  # one all-reduce per bucket, launched in the order backward fills them
        sizes = [min(BUCKET, numel - start) * 8 for start in range(0, numel, BUCKET)]
        return sorted(("all_reduce", "dp_cp", b, 2 * b * (d - 1) // d) for b in sizes)
    clip = ("all_reduce", "dp_cp", 8, 2 * 8 * (d - 1) // d)
    if stage in SHARDED_BUCKETS:  # per bucket: one reduce-scatter, one all-gather (lazy, or eager)
        count, size = equal_buckets(numel, d)
        rs, ag = ("reduce_scatter", "dp_cp", size * 8, size * 8 * (d - 1) // d), ("all_gather", "dp_cp", size * 8,
                                                                                   size * 8 * (d - 1) // d)
        gathers = count * (step > 0 or stage == "distopt_buckets")
        return sorted([rs] * count + [ag] * gathers + [clip])
    rs, ag = ("reduce_scatter", "dp_cp", padded, share), ("all_gather", "dp_cp", padded, share)
    return {
        "zero1": [ag] * (step > 0) + [rs, clip],  # lazy: gathered before the next forward
        "zero2": [ag] * (step > 0) + [rs, clip],
        "distopt": [rs, clip, ag],  # eager: gathered right after the step
    }[stage]


# Per-parameter .grad bytes at their peak, by hand for the test model (float64): unbucketed stages keep every
# gradient until the step; the in-place buckets (DDP, ZeRO-1, distributed optimizer) add each one into the main
# buffer on arrival, so one tensor at a time, the largest being 576 elements (embedding, output, each stacked
# expert matrix); ZeRO-2's buckets of 496 cut every stacked expert matrix, so w2 waits for the bucket it shares
# with w3 to fill: two 576-element tensors; ZeRO-3 frees a unit's gradients when the unit is complete: one block.
LARGEST_TENSOR, BLOCK = 576, 3132


def param_grad_bytes(stage: str, numel: int) -> int:
    if stage in ("ddp", "zero1", "zero2", "distopt"):
        return numel * 8
    if stage == "zero2_buckets":
        return 2 * LARGEST_TENSOR * 8
    return (BLOCK if stage in ZERO3 else LARGEST_TENSOR) * 8


def expected_state(stage: str, numel: int, d: int, units: list[int]):
    return model_states(stage, numel, d, units) | {"param_grads": param_grad_bytes(stage, numel)}


def model_states(stage: str, numel: int, d: int, units: list[int]):
    shard, padded = -(-numel // d) * 8, -(-numel // d) * d * 8
    if stage in ("ddp", "ddp_buckets"):  # all_reduce returns a new full buffer; the bucketed one sums in place
        return {"params": numel * 8, "grads": numel * 8, "main_params": 0, "optimizer": 2 * numel * 8,
                "gathered_params": 0, "grad_buckets": numel * 8 if stage == "ddp" else 0}
    if stage in SHARDED_BUCKETS:  # buckets padded one by one; one reduce-scatter in flight at a time
        count, size = equal_buckets(numel, d)
        full, shard = count * size * 8, count * size // d * 8
        wire = size * 8 if stage == "zero2_buckets" else 0  # the others reduce their full buffer where it lies
        return {"params": full, "grads": shard if stage == "zero2_buckets" else full, "main_params": 0,
                "optimizer": 2 * shard, "gathered_params": 0, "grad_buckets": wire + size // d * 8}
    if stage not in ZERO3:  # the reduced slice, and ZeRO-2's temporary padded full buffer beside it
        return {"params": padded, "grads": shard if stage == "zero2" else padded, "main_params": 0,
                "optimizer": 2 * shard, "gathered_params": 0, "grad_buckets": shard + padded * (stage == "zero2")}
    shard = sum(-(-u // d) for u in units) * 8  # every unit padded on its own
    full = [-(-u // d) * d * 8 for u in units]
    gathered = {"zero3": max(a + b for a, b in zip(full, full[1:], strict=False)),  # the unit in use and the next one
                "zero3_serial": max(full), "zero3_keep": sum(full)}[stage]
    wire = max(b + b // d for b in full)  # one unit's wire buffer and its reduced slice
    return {"params": shard, "grads": shard, "main_params": 0, "optimizer": 2 * shard,
            "gathered_params": gathered, "grad_buckets": wire}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_stage_matches_one_device_with_exact_ledger_and_memory(layout):
    d = layout.dp * layout.cp
    ref_losses, ref_params, ref_grads = reference(d)
    results = run_distributed(all_stages, layout.world_size, args=(layout,))
    for rank, by_stage in enumerate(results):
        for stage, (_, params, step_records, state, numel, _) in by_stage.items():
            assert d == 2 or numel % d, "the test model should exercise padding"
            where = f"rank {rank} {stage}"
            mean_losses = [sum(r[stage][0][s] for r in results[:: layout.tp]) / d for s in range(STEPS)]
            torch.testing.assert_close(mean_losses, ref_losses, rtol=1e-9, atol=0, msg=where)
            torch.testing.assert_close(params, ref_params, rtol=1e-9, atol=1e-12, msg=where)
            for step in range(STEPS):
                torch.testing.assert_close(full_grads(results, stage, step, layout), ref_grads[step], rtol=1e-9,
                                           atol=1e-12, msg=f"{where} step {step} gradients")
            units = unit_numels()  # tp ranks replicate here
            assert sum(units) == numel, where
            for step, records in enumerate(step_records):
                if stage in ZERO3:
                    assert sorted(records) == zero3_records(stage, units, d), f"{where} step {step}"
                    continue
                got = sorted(records) if stage in ("ddp_buckets", *SHARDED_BUCKETS) else records
                assert got == expected_records(stage, step, numel, d), f"{where} step {step}"
            model_state = {k: v for k, v in state.items() if k != "activations"}
            assert model_state == expected_state(stage, numel, d, units), where
            # Sharding is model state only: ZeRO-3's gathered weights must not count as activations.
            assert state["activations"] == by_stage["ddp"][3]["activations"] > 0, where


def bf16_zero2():
    losses, _, step_records, state, numel, _ = data_parallel_run(Layout(dp=2), "zero2", param_dtype="bfloat16")
    state.pop("activations")
    return losses, step_records[-1], state, numel


def test_bfloat16_params_keep_fp32_main_state_and_reduce_in_bf16():
    (losses, records, state, numel), (other_losses, *_) = run_distributed(bf16_zero2, 2)
    mean_losses = [(a + b) / 2 for a, b in zip(losses, other_losses, strict=True)]
    torch.testing.assert_close(mean_losses, reference(2)[0], rtol=2e-2, atol=0)  # bf16 tracks float64
    shard, padded = -(-numel // 2), -(-numel // 2) * 2
    assert state == {"params": padded * 2, "grads": shard * 4, "main_params": shard * 4, "optimizer": shard * 8,
                     "gathered_params": 0, "grad_buckets": padded * 2 + shard * 2,  # bf16 full buffer and slice
                     "param_grads": numel * 2}  # every bf16 .grad, until the step
    assert records[0] == ("all_gather", "dp_cp", padded * 2, shard * 2)  # params travel in bf16
    assert records[1] == ("reduce_scatter", "dp_cp", padded * 2, shard * 2)  # and so do gradients


TRANSIENT_RUNS = {"ddp_bf16": ("ddp", "bfloat16"), "zero1_bf16": ("zero1", "bfloat16"),
                  "ddp_buckets_bf16": ("ddp_buckets", "bfloat16"), "ddp_buckets_f32": ("ddp_buckets", "float32"),
                  "zero2_f32": ("zero2", "float32")}


def transient_runs():
    return {name: data_parallel_run(Layout(dp=4), stage, dtype)[3]["grad_buckets"]
            for name, (stage, dtype) in TRANSIENT_RUNS.items()}


def test_reduction_buffers_count_in_grad_buckets_when_dtypes_differ_and_unbucketed():
    """The reduction's transient bytes, written out by hand for the 7434-element model on dp=4 (padded to
    7436, slices of 1859; buckets of 500, the last one 434 elements)."""
    assert sum(unit_numels()) == 7434  # the plain model
    expected = {
        "ddp_bf16": 7434 * 2 + 7434 * 2,  # the bf16 wire copy of the fp32 main gradients and all_reduce's result
        "zero1_bf16": 7436 * 2 + 1859 * 2,  # the bf16 wire copy of the padded buffer and its reduced slice
        "ddp_buckets_bf16": (14 * 500 + 434) * 2,  # every bucket's bf16 wire copy, in flight until the step
        "ddp_buckets_f32": 0,  # summed in place where they lie
        "zero2_f32": 7436 * 4 + 1859 * 4,  # the temporary padded full buffer and its reduced slice
    }
    assert run_distributed(transient_runs, 4) == [expected] * 4
    for name, (stage, dtype) in TRANSIENT_RUNS.items():
        config = ParallelConfig(param_dtype=dtype, **STAGES[stage])
        _, predicted = predicted_step(CFG, Layout(dp=4), config, seq_len=SEQ, micro_batch=PER_RANK)
        assert predicted["grad_buckets"] == expected[name], name


@pytest.mark.parametrize("stage", STAGES)
def test_planner_predicts_the_per_parameter_gradients_by_hand(stage):
    config = ParallelConfig(param_dtype="float64", **STAGES[stage])
    _, predicted = predicted_step(CFG, Layout(dp=2), config, seq_len=SEQ, micro_batch=PER_RANK)
    assert predicted["param_grads"] == param_grad_bytes(stage, 7434)


def accumulated_param_grads(stage: str) -> int:
    """Peak .grad bytes of one step of two micro-batches, the first inside no_sync."""
    dp = DataParallel(Transformer(CFG, seed=0, dtype=torch.float64), init_mesh(Layout(dp=2)),
                      ParallelConfig(param_dtype="float64", **STAGES[stage]))
    rows = batch(0, 2 * PER_RANK)
    with dp.no_sync():
        ce(dp(rows[:1, :-1]), rows[:1]).backward()
    ce(dp(rows[1:, :-1]), rows[1:]).backward()
    dp.reduce_gradients()
    return dp.transient_peaks()["param_grads"]


def accumulated_runs(stages: tuple[str, ...]) -> dict[str, int]:
    return {stage: accumulated_param_grads(stage) for stage in stages}


def test_no_sync_keeps_every_gradient_until_the_last_micro_batch_under_zero2_buckets_and_zero3():
    """Under ZeRO-2 and ZeRO-3 the first micro-batch's gradients wait in .grad: all 7434 elements at once,
    where one micro-batch holds two expert matrices or one block (in-place buckets still hold one tensor)."""
    stages = ("zero2_buckets", "zero3", "ddp_buckets")
    measured = run_distributed(accumulated_runs, 2, args=(stages,))
    expected = {"zero2_buckets": 7434 * 8, "zero3": 7434 * 8, "ddp_buckets": LARGEST_TENSOR * 8}
    assert measured == [expected] * 2
    for stage in stages:
        config = ParallelConfig(param_dtype="float64", microbatches=2, **STAGES[stage])
        _, predicted = predicted_step(CFG, Layout(dp=2), config, seq_len=SEQ, micro_batch=1)
        assert predicted["param_grads"] == expected[stage], stage


def zero3_every_microbatch_step(every: bool) -> dict:
    """One step of two micro-batches under ZeRO-3 (the first inside no_sync): whole averaged gradients, the
    step's reduce-scatters, the peak .grad bytes and the parameters after one AdamW step."""
    config = ParallelConfig(param_dtype="float64", zero_stage=3, zero3_reduce_every_microbatch=every)
    dp = DataParallel(Transformer(CFG, seed=0, dtype=torch.float64), init_mesh(Layout(dp=2)), config)
    opt = dp.optimizer(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = dp.group
    rows = batch(0, 2 * PER_RANK)[g.rank * PER_RANK:(g.rank + 1) * PER_RANK]
    with comm.measure() as records:
        with dp.no_sync():
            (ce(dp(rows[:1, :-1]), rows[:1]) / 2).backward()
        (ce(dp(rows[1:, :-1]), rows[1:]) / 2).backward()
        dp.reduce_gradients()
    with comm.unmeasured():
        grads = dp.full_grads()
    opt.step()
    with comm.unmeasured():
        params = dp.full_state(opt)["params"]
    scatters = sorted(r.payload_bytes for r in records if r.op == "reduce_scatter")
    return {"grads": grads, "params": params, "scatters": scatters,
            "param_grads": dp.transient_peaks()["param_grads"]}


def zero3_every_microbatch_runs() -> dict:
    return {every: zero3_every_microbatch_step(every) for every in (False, True)}


def test_zero3_reduce_every_microbatch_matches_one_device_with_one_unit_of_grads():
    """Reduce-scattering each micro-batch into the sharded main buffer gives the gradients and the AdamW step of
    one device (torch.optim.AdamW), as reducing once does, with twice the reduce-scatters, and holds one block's
    .grad (3132 x 8 bytes) where accumulating in .grad holds all 7434 elements."""
    ref = Transformer(CFG, seed=0, dtype=torch.float64)
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), foreach=False)
    tokens = batch(0, 2 * PER_RANK)
    ce(ref(tokens[:, :-1]), tokens).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt.step()
    results = run_distributed(zero3_every_microbatch_runs, 2)
    units = [-(-u // 2) * 2 * 8 for u in unit_numels()]  # each unit padded to dp=2, float64
    for every, result in results[0].items():
        for name, ref_grad in ref_grads.items():
            torch.testing.assert_close(result["grads"][name], ref_grad, rtol=1e-9, atol=1e-12, msg=name)
        assert result["scatters"] == sorted(units * (2 if every else 1))
        assert result["param_grads"] == (BLOCK if every else 7434) * 8
        config = ParallelConfig(param_dtype="float64", zero_stage=3, zero3_reduce_every_microbatch=every,
                                microbatches=2)
        _, predicted = predicted_step(CFG, Layout(dp=2), config, seq_len=SEQ, micro_batch=1)
        assert predicted["param_grads"] == result["param_grads"]
        for name, p in ref.named_parameters():  # and the same AdamW step
            torch.testing.assert_close(result["params"][name], p.detach(), rtol=1e-9, atol=1e-12, msg=name)


def test_parallel_config_rules():
    with pytest.raises(ParallelConfigError, match=r"zero_stage=4: must be 0 \(DDP\), 1, 2 or 3"):
        ParallelConfig(zero_stage=4)
    with pytest.raises(RuleError, match=r"distributed_optimizer with zero_stage=3"):
        ParallelConfig(zero_stage=3, distributed_optimizer=True)
    with pytest.raises(RuleError, match=r"cp_mode='spiral': must be one of ring"):
        ParallelConfig(cp_mode="spiral")
    with pytest.raises(ParallelConfigError, match=r"microbatches=0: must be a positive integer"):
        ParallelConfig(microbatches=0)
    # Options the planner prices but the runtime does not run: built, then refused by the runtime's check.
    with pytest.raises(ParallelConfigError, match=r"param_dtype='float16': must be one of float64, float32, bfloat16"):
        check_runnable(ParallelConfig(param_dtype="float16"))
    with pytest.raises(RuleError, match=r"grad_bucket_numel=100 with zero_stage=3: ZeRO-3 reduce-scatters"):
        check_runnable(ParallelConfig(zero_stage=3, grad_bucket_numel=100))



# ---- awkward uses: several outputs, a tied weight used last, accumulation, eval and unused forwards ------


class TiedTwoOutputs(torch.nn.Module):
    """Returns (h, logits) where logits reuse the embedding after h: ZeRO-3 must gather before either."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(11, 6, dtype=torch.float64)
        self.lin = torch.nn.Linear(6, 6, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(self.lin(self.emb(x)))
        return h, h @ self.emb.weight.t()


def awkward_steps(model, rows_of):
    """Two steps of two accumulated micro-batches, with an eval forward and an unused forward in between."""
    for step in range(2):
        for mb in range(2):
            x = rows_of(batch(10 * step + mb, 4)[:, :5] % 11)
            model(x)  # a forward whose graph is dropped
            h, logits = model(x)
            with torch.no_grad():
                model(x)  # evaluation between forward and backward
            loss = (ce(logits[:, :-1], x) + h.square().mean()) / 2
            with getattr(model, "no_sync", contextlib.nullcontext)() if mb == 0 else contextlib.nullcontext():
                loss.backward()
        yield step


def awkward_reference():
    model = TiedTwoOutputs()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0, foreach=False)

    class Mean(torch.nn.Module):  # the mean over 2 ranks of each rank's mean loss, on one device
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            parts = [self.inner(x[r * 2:(r + 1) * 2]) for r in range(2)]
            return tuple(torch.cat([p[i] for p in parts]) for i in range(2))

    for _ in awkward_steps(Mean(), lambda rows: rows):
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def awkward_run():
    mesh = init_mesh(Layout(dp=2))
    r = mesh["dp_cp"].rank
    out = {}
    for stage, opts in STAGES.items():
        if opts.get("grad_bucket_numel"):  # several buckets of the small model, cutting through its weights
            opts = opts | {"grad_bucket_numel": 30}
        dp = DataParallel(TiedTwoOutputs(), mesh, ParallelConfig(param_dtype="float64", **opts))
        opt = dp.optimizer(lr=0.05)
        for _ in awkward_steps(dp, lambda rows, r=r: rows[r * 2:(r + 1) * 2]):
            opt.step()
            opt.zero_grad()
        dp.gather_params()  # whole parameters to read, where the strategy shards them
        out[stage] = torch.cat([p.detach().reshape(-1) for p in dp.module.parameters()])
    return out


def test_several_outputs_accumulation_and_eval_match_one_device():
    reference_params = awkward_reference()
    for by_stage in run_distributed(awkward_run, 2):
        for stage, params in by_stage.items():
            torch.testing.assert_close(params, reference_params, rtol=1e-9, atol=1e-12, msg=stage)


def bucket_overlap_checks():
    mesh = init_mesh(Layout(dp=2))
    dp = DataParallel(Transformer(CFG, seed=0, dtype=torch.float64), mesh,
                      ParallelConfig(param_dtype="float64", grad_bucket_numel=BUCKET))
    rows = batch(0, 2)
    ce(dp(rows[:, :-1]), rows).backward()
    launched_during_backward = len(dp.buckets.in_flight)
    dp.reduce_gradients()
    with pytest.raises(RuntimeError, match="a second gradient arrived before the step; run the earlier"):
        ce(dp(rows[:, :-1]), rows).backward()
        ce(dp(rows[:, :-1]), rows).backward()  # accumulation without no_sync
    return launched_during_backward, len(dp.buckets.bounds)


def test_buckets_are_reduced_during_backward():
    for launched, buckets in run_distributed(bucket_overlap_checks, 2):
        assert buckets > 5 and launched == buckets  # every bucket left before the step asked for it


def sharded_bucket_checks():
    """Per sharded stage with buckets: the buckets launched by the time the embedding's gradient (the last one
    backward computes) arrives, what is left in .grad and in flight after backward, and the refusal of a
    second gradient without no_sync."""
    mesh = init_mesh(Layout(dp=2))
    out = {}
    for stage in SHARDED_BUCKETS:
        model = Transformer(CFG, seed=0, dtype=torch.float64)
        seen = {}

        def at_embedding(_: torch.Tensor, seen: dict = seen) -> None:
            seen.setdefault("launched", list(seen["dp"].buckets.events))

        # Registered before the wrapper's hooks, so it runs before they take the embedding's gradient.
        model.tok_embeddings.weight.register_post_accumulate_grad_hook(at_embedding)
        seen["dp"] = dp = DataParallel(model, mesh, ParallelConfig(param_dtype="float64", **STAGES[stage]))
        rows = batch(0, 2)
        ce(dp(rows[:, :-1]), rows).backward()
        seen["grads_left"] = [n for n, p in dp.module.named_parameters() if p.grad is not None]
        seen["in_flight"] = len(dp.buckets.in_flight)
        dp.reduce_gradients()
        with pytest.raises(RuntimeError, match="a second gradient arrived before the step; run the earlier"):
            ce(dp(rows[:, :-1]), rows).backward()
            ce(dp(rows[:, :-1]), rows).backward()  # accumulation without no_sync
        del seen["dp"]
        out[stage] = seen
    return out


def test_sharded_buckets_are_reduce_scattered_during_backward():
    count, size = equal_buckets(sum(unit_numels()), 2)
    embedding = CFG.vocab_size * CFG.dim  # the first elements of the flat buffer, its first buckets
    for by_stage in run_distributed(sharded_bucket_checks, 2):
        for stage, seen in by_stage.items():
            assert count > 5, stage
            assert seen["launched"][0] == count - 1, stage  # the head's bucket first, as backward fills it
            # Every bucket without embedding elements left while backward still had the embedding to do.
            assert sorted(seen["launched"]) == list(range(embedding // size + 1, count)), stage
            assert seen["grads_left"] == [], stage  # every .grad freed once in its bucket
            assert seen["in_flight"] == 1, stage  # the last bucket's reduce-scatter; the step waits for it


def zero3_unit_checks(opts: dict):
    """Gathered bytes at points of a ZeRO-3 step, the peak, and what was launched before backward ended."""
    mesh = init_mesh(Layout(dp=2))
    dp = DataParallel(Transformer(CFG, seed=0, dtype=torch.float64), mesh,
                      ParallelConfig(param_dtype="float64", zero_stage=3, **opts))
    live = dp.transient.live
    held = {"built": live["gathered_params"]}

    # The embedding's gradient is the last one backward computes: what was launched before it is overlap.
    def in_backward(_: torch.Tensor) -> None:
        held.setdefault("launched_in_backward", list(dp.schedule.events))

    dp.module.tok_embeddings.weight.register_post_accumulate_grad_hook(in_backward)
    def at_block0(*_) -> None:
        held.setdefault("launched_at_block0", list(dp.schedule.events))

    dp.module.tok_embeddings.register_forward_hook(at_block0)  # the embedding has just run
    rows = batch(0, 2)
    loss = ce(dp(rows[:, :-1]), rows)
    held["after_forward"] = live["gathered_params"]
    dp.schedule.events.clear()
    loss.backward()
    held["after_backward"] = live["gathered_params"]
    with torch.no_grad():
        dp(rows[:, :-1])
    held["after_eval_forward"] = live["gathered_params"]
    return held, dp.transient_peaks()["gathered_params"], unit_numels()


def test_zero3_gathers_unit_by_unit_frees_after_use_and_overlaps():
    for opts in ({}, {"zero3_prefetch": False}):
        for held, peak, units in run_distributed(zero3_unit_checks, 2, args=(opts,)):
            full = [-(-u // 2) * 2 * 8 for u in units]
            events = held.pop("launched_in_backward")
            at_block0 = held.pop("launched_at_block0")
            assert held == {"built": 0, "after_forward": 0, "after_backward": 0, "after_eval_forward": 0}, opts
            two_units = max(a + b for a, b in zip(full, full[1:], strict=False))
            assert peak <= two_units < sum(full), opts  # two units, not the model
            last = len(units) - 1  # the head: its backward comes first, and so do its gradients
            assert ("reduce", last) in events, opts  # a unit's reduce-scatter left before backward ended
            if opts:  # without prefetch, nothing is gathered ahead of use
                assert peak == max(full)
                assert ("gather", 1) not in at_block0
                continue
            assert ("gather", 1) in at_block0  # block 0 (unit 1) on its way while the embedding ran
            # The unit before the head was prefetched when the head's backward began, before it reduced.
            assert events.index(("gather", last - 1)) < events.index(("reduce", last))
