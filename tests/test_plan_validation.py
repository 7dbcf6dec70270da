"""The planner against published runs: every row of src/orangetron/plan/validation_runs.toml, which records
each row's source, class, split (calibration or validation) and the date it was added. The protocol and the
reading of each row are in docs/planner.md ('Validation protocol' and section 6).

The report test prints in-sample (calibration) and out-of-sample (validation) errors side by side, per class
and overall, for throughput and memory, with validation rows added after the last refit apart; it asserts the
issue's goals only where they hold and states the others as report lines. Per-row bands (`band` in the file)
and the aggregate bands below are what the current figures satisfy, so a change that moves them fails here.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import date

import pytest

from orangetron.plan import reserved, validation
from orangetron.plan.memory import StageParams, memory_per_gpu, model_state_bytes, stage_memory
from orangetron.plan.timing import DEFAULT_EFFICIENCY
from orangetron.spec.hardware import load_gpu
from orangetron.spec.model import ModelSpec, load_model
from orangetron.spec.options import Degrees, Job

TABLE = validation.load_table()
RUNS = validation.load_runs()
MEMORY = TABLE["memory"]
# The split was fixed on this date, before any constant was refitted (the file's header).
SPLIT_FIXED = date(2026, 12, 3)
LAST_REFIT = TABLE.get("refit", {}).get("date", SPLIT_FIXED)
# Every dense figure of Megatron-Bridge 25.11 on a Blackwell preset (but one layout the planner cannot price),
# added on 2026-12-04 to the calibration split for Blackwell's GEMM efficiency, which no calibration row had fitted.
BLACKWELL_DENSE = {f"Megatron-Bridge 25.11 {run}" for run in (
    "Llama 3 8B, 8 GB200, FP8-CS", "Llama 3 8B, 8 GB200, FP8-MX", "Llama 3 8B, 8 B200, FP8-CS",
    "Llama 3 8B, 8 B200, FP8-MX", "Llama 3.1 405B, 256 GB200, FP8-CS", "Llama 3.1 405B, 128 B200, FP8-CS",
    "Llama 3.1 405B, 128 B200, FP8-MX")}


def test_rows_have_a_split_a_class_by_the_rule_a_source_and_a_date():
    names = [r.name for r in RUNS] + [m["name"] for m in MEMORY] + [r.name for r in reserved.load_reserved()]
    assert len(names) == len(set(names))
    for run in RUNS:
        assert run.split in validation.SPLITS and run.source and run.added <= date.today(), run.name
        assert run.cls == validation.class_of(run.model, run.deg, run.job), run.name
        # A row added after the split was fixed is judged, never fitted on, except the rows added for a constant no
        # calibration row had fitted (below).
        assert run.split == "validation" or run.added <= SPLIT_FIXED or run.name in BLACKWELL_DENSE, run.name
    for row in MEMORY:
        assert (row["class"], row["split"]) == ("memory", "validation") and row["source"], row["name"]
    for cls in validation.CLASSES:
        assert sum(r.cls == cls and r.split == "validation" for r in RUNS) >= 3, cls
    # The calibration split, pinned: the 19 rows the shipped constants had been chosen on, the two MoE rows added
    # on the split's day for the host pacing, and the seven dense Blackwell rows added on 2026-12-04 for Blackwell's
    # GEMM efficiency, until then set by hand, each set by the rule docs/planner.md records ('Validation protocol').
    assert sum(r.split == "calibration" for r in RUNS) == 28
    assert {r.name for r in RUNS if r.split == "calibration" and r.cls == "moe"} == {
        "Megatron-Bridge 25.11 Qwen3-235B-A22B, 256 GB200, BF16", "Megatron-Bridge 25.11 Qwen3-235B-A22B, 64 B200, FP8"}
    assert {r.name for r in RUNS if r.split == "calibration" and r.added > SPLIT_FIXED} == BLACKWELL_DENSE


def test_class_rule_on_hand_made_layouts():
    dense = ModelSpec(name="d", hidden_size=256, num_layers=4, num_heads=4, vocab_size=1024, ffn_hidden_size=1024)
    moe = replace(dense, num_experts=4, top_k=2, moe_ffn_hidden_size=256)
    short, long = Job(seq_len=4096), Job(seq_len=32768)
    assert validation.class_of(moe, Degrees(pp=2), replace(short, zero_stage=3)) == "moe"
    assert validation.class_of(dense, Degrees(cp=2), replace(short, zero_stage=3)) == "fully sharded"
    assert validation.class_of(dense, Degrees(pp=2), long) == "long context"
    assert validation.class_of(dense, Degrees(pp=2, cp=2), short) == "long context"
    assert validation.class_of(dense, Degrees(pp=2), short) == "pipeline"
    assert validation.class_of(dense, Degrees(tp=8, dp=4), short) == "size"


@pytest.fixture(scope="module")
def scored() -> list[validation.Scored]:
    return [validation.Scored(r.name, r.cls, r.split, r.added, validation.relative_error(r)) for r in RUNS]


BANDED = [r for r in RUNS if r.band]


@pytest.mark.parametrize("run", BANDED, ids=[r.name for r in BANDED])
def test_each_run_within_its_band(run):
    low, high = run.band
    assert low <= validation.relative_error(run) <= high


def test_the_former_held_out_rows_stay_inside_their_aggregate_bands(scored):
    """The 27 rows that carry a band (the held-out set before this protocol, SC'21 included): mean <= 12%,
    every class <= 20%, and worst <= 34%: the refit of 2026-12-03 (A100 GEMMs 0.80 -> 0.83) took MT-NLG on 3360
    GPUs from +29.7% to +33.5%."""
    banded = [s for s in scored if s.name in {r.name for r in BANDED}]
    assert sum(abs(s.error) for s in banded) / len(banded) <= 0.12
    assert max(abs(s.error) for s in banded) <= 0.34
    for cls in {s.cls for s in banded}:
        mine = [abs(s.error) for s in banded if s.cls == cls]
        assert sum(mine) / len(mine) <= 0.20, cls


def test_side_by_side_report_by_hand():
    """Two calibration rows (-10%, +20%), one validation row added before the refit's day (+30%), one on it (-50%)
    and one after it (+5%), all of class size: each column holds its own rows, means and worsts of |error|."""
    refit, early, late = date(2026, 12, 3), date(2026, 11, 30), date(2026, 12, 4)
    rows = [validation.Scored("a", "size", "calibration", early, -0.10),
            validation.Scored("b", "size", "calibration", early, 0.20),
            validation.Scored("c", "size", "validation", early, 0.30),
            validation.Scored("d", "size", "validation", refit, -0.50),
            validation.Scored("e", "size", "validation", late, 0.05)]
    lines = validation.side_by_side(rows, refit, "throughput")
    assert lines[1].split() == ["size", "2", "15.0%", "20.0%", "1", "30.0%", "30.0%", "2", "27.5%", "50.0%"]
    assert lines[2].split()[1:] == lines[1].split()[1:]  # "all" is the one class
    assert validation.summary(rows, "calibration") == (2, pytest.approx(0.15), pytest.approx(0.20))
    assert validation.summary(rows, "validation", "moe") == (0, 0.0, 0.0)


# ---- fitted constants ---------------------------------------------------------------------------------------
FITTED = validation.load_fitted()


@pytest.mark.parametrize("fitted", FITTED, ids=lambda f: f.name)
def test_each_fitted_constant_names_its_calibration_rows_and_is_shipped_in_every_preset(fitted):
    """A constant is fitted on every calibration row on its presets and on nothing else, and each preset ships the
    value the file records."""
    on_presets = {r.name for r in RUNS if r.split == "calibration" and r.gpu in fitted.presets}
    assert set(fitted.rows) == on_presets and len(fitted.rows) == len(on_presets) > 0
    for preset in fitted.presets:
        assert getattr(load_gpu(preset), fitted.constant) == fitted.value, preset


@pytest.mark.parametrize("fitted", FITTED, ids=lambda f: f.name)
def test_refit_from_calibration_rows_reproduces_the_shipped_value(fitted):
    value = validation.refit(fitted, RUNS)
    assert value == fitted.value
    # A minimum on the grid, not an edge: the fit did not run out of room.
    low, high, _ = fitted.grid
    assert low < value < high


def test_refit_refuses_a_validation_row():
    fitted = replace(FITTED[0], rows=(*FITTED[0].rows, "NeMo LLAMA2-7B 4K"))
    with pytest.raises(ValueError, match="fitted on a row outside the calibration split"):
        validation.refit(fitted, RUNS)


def test_refit_moves_with_the_published_figures():
    """Published figures 10% lower on every Ampere row pull the fitted GEMM efficiency down, and 10% higher push
    it up: the fit reads the rows, not the shipped value."""
    ampere = next(f for f in FITTED if "a100-80gb" in f.presets)
    for scale, moves in ((0.9, lambda v: v < ampere.value), (1.1, lambda v: v > ampere.value)):
        scaled = [replace(r, published=r.published * scale) if r.name in ampere.rows else r for r in RUNS]
        assert moves(validation.refit(ampere, scaled)), scale


FITTED_EFFICIENCY = validation.load_fitted_efficiency()


def test_host_operation_time_is_fitted_on_every_calibration_moe_row_and_shipped():
    """The MoE layers' host pacing (plan/host.py) has one fitted constant, fitted on every calibration row of
    its class and on nothing else, and `DEFAULT_EFFICIENCY` ships the value the file records."""
    (fitted,) = FITTED_EFFICIENCY
    assert (fitted.field, fitted.cls) == ("host_op_s", "moe")
    of_class = {r.name for r in RUNS if r.split == "calibration" and r.cls == fitted.cls}
    assert set(fitted.rows) == of_class and len(fitted.rows) == len(of_class) >= 2
    assert getattr(DEFAULT_EFFICIENCY, fitted.field) == fitted.value


def test_megatron_moe_rows_run_their_all_to_all_as_their_flags_say():
    """Megatron-Core overlaps the expert all-to-all with another micro-batch only under
    --overlap-moe-expert-parallel-comm; the GB200 guide's flags and Megatron-Bridge 25.11's configs leave it off
    (docs/planner.md, section 6, 2026-12-05), so every MoE row of theirs is priced with it exposed, the two
    calibration rows included. The model zoo's rows say each its own; DeepSeek-V3's own run pairs micro-batches
    (DualPipe)."""
    megatron = [r for r in RUNS if r.cls == "moe" and r.group in ("bridge-25.11", "gb200-guide")]
    assert len(megatron) == 16 and sum(r.split == "calibration" for r in megatron) == 2  # 3 on GB300
    assert not any(r.job.overlap_ep for r in megatron)
    # the guide lists every flag, and --moe-shared-expert-overlap is not one; the Bridge's recipes are not read
    assert {r.name for r in RUNS if not r.job.overlap_shared_experts} == {
        r.name for r in megatron if r.group == "gb200-guide"}
    assert {r.name: r.job.overlap_ep for r in RUNS if r.group in ("deepseek-v3", "moe-modelzoo")} == {
        "DeepSeek-V3, 2048 GPUs": True,
        "MoE model zoo Qwen3-235B-A22B, tp2 ep32 pp8 vp4, DeepEP": False,
        "MoE model zoo Qwen3-235B-A22B, tp2 ep32 pp8 vp4, DeepEP, EP overlap": True,
        "MoE model zoo Qwen3-235B-A22B, tp2 ep8 FSDP, mb 4, DeepEP": False,
        "MoE model zoo Qwen3-235B-A22B, tp4 ep8 pp8 vp4, DeepEP": False,
    }


def test_nemo_rows_keep_their_gradients_in_bf16_where_their_scripts_say():
    """NeMo-Framework-Launcher's H100 FP8 example scripts of GPT-3 5B, 20B and 175B, Llama 2 70B and Llama 3 8B
    and 70B pass `grad_sync_dtype=bf16` to the distributed Adam, whose contiguous gradient buffer takes that
    dtype (docs/planner.md, section 6, 2026-12-07); those of Llama 2 7B and 13B do not. With the buffer in bf16
    GPT-3 20B fits, as it ran; with fp32 it would not."""
    bf16 = {r.name for r in RUNS if r.job.grad_dtype == "bfloat16"}
    assert bf16 == {"NeMo 24.07 GPT3-5B", "NeMo 24.07 GPT3-20B", "NeMo 24.07 GPT3-175B 128",
                    "NeMo 24.07 GPT3-175B 512", "NeMo 24.07 LLAMA2-70B", "NeMo 24.07 LLAMA3-8B",
                    "NeMo 24.07 LLAMA3-70B"}
    for run in RUNS:
        if run.name in bf16:
            assert run.job.grad_accumulation_fusion and "grad_sync_dtype=bf16" in run.source
    (gpt3_20b,) = [r for r in RUNS if r.name == "NeMo 24.07 GPT3-20B"]
    assert validation.fitting_jobs(gpt3_20b)
    assert not validation.fitting_jobs(replace(gpt3_20b, job=replace(gpt3_20b.job, grad_dtype="float32")))


def test_rows_overlap_tensor_parallel_traffic_where_their_configs_say():
    """Transformer Engine's userbuffers overlap (`tp_comm_overlap`) is priced on the rows whose framework config
    was read to turn it on (docs/planner.md, section 6, 2026-12-07): the NeMo 24.07 launcher configs of GPT-3
    20B and 175B and Llama 3 70B (`ub_tp_comm_overlap: true`; the Llama 2 70B config read says false) and the
    Megatron-Bridge Llama 3 70B and 3.1 405B recipes; every other row runs its TP traffic blocking."""
    overlapped = {r.name for r in RUNS if r.job.tp_comm_overlap}
    assert overlapped == {
        "NeMo 24.07 GPT3-20B", "NeMo 24.07 GPT3-175B 128", "NeMo 24.07 GPT3-175B 512", "NeMo 24.07 LLAMA3-70B",
        "Megatron-Bridge 25.11 Llama 3 70B, 64 H100, FP8-CS", "Megatron-Bridge 25.11 Llama 3.1 405B, 1024 H100, FP8-CS",
        "Megatron-Bridge 25.11 Llama 3.1 405B, 256 GB200, FP8-CS",
        "Megatron-Bridge 25.11 Llama 3.1 405B, 256 GB300, FP8-CS",
        "Megatron-Bridge 25.11 Llama 3.1 405B, 128 B200, FP8-CS",
        "Megatron-Bridge 25.11 Llama 3.1 405B, 128 B200, FP8-MX"}
    for run in RUNS:
        if run.name in overlapped:
            assert run.deg.tp > 1 and run.job.sequence_parallel and "tp_comm_overlap" in run.source


@pytest.mark.parametrize("fitted", FITTED_EFFICIENCY, ids=lambda f: f.name)
def test_refit_of_an_efficiency_reproduces_the_shipped_value_and_reads_the_rows(fitted):
    value = validation.refit_efficiency(fitted, RUNS)
    assert value == fitted.value
    low, high, _ = fitted.grid
    assert low < value < high
    # Published figures 20% lower on its rows need a slower host; a validation row cannot be fitted on.
    slower = [replace(r, published=0.8 * r.published) if r.name in fitted.rows else r for r in RUNS]
    assert validation.refit_efficiency(fitted, slower) > fitted.value
    with pytest.raises(ValueError, match="fitted on a row outside the calibration split"):
        validation.refit_efficiency(replace(fitted, rows=(*fitted.rows, "NeMo LLAMA2-7B 4K")), RUNS)


# ---- memory -------------------------------------------------------------------------------------------------
def gpt(heads: int, hidden: int, layers: int, vocab: int, dropout: float, positions: int) -> ModelSpec:
    return ModelSpec(name=f"gpt-{hidden}x{layers}", hidden_size=hidden, num_layers=layers, num_heads=heads,
                     vocab_size=vocab, ffn_hidden_size=4 * hidden, mlp="gelu", dropout=dropout, bias=True,
                     max_position_embeddings=positions, tied_embeddings=True)


def zero_model_states_gb(row: dict) -> float:
    """Rajbhandari et al. 2020 (ZeRO) Table 1's arithmetic: fp16 parameters and gradients, K = 12 bytes of fp32
    optimizer state per parameter."""
    job = Job(seq_len=1024, zero_stage=row["zero_stage"], param_dtype="float16", grad_dtype="float16")
    return sum(model_state_bytes(StageParams(int(row["parameters"]), 0), Degrees(dp=row["dp"]), job).values()) / 1e9


def megatron_peak(row: dict) -> int:
    """The planner's last-stage bytes for a Megatron-LM CI case (12 layers, hidden 512, 8 heads, GPT-2 vocabulary
    padded to 128 x tp, learned positions 1024), with Megatron's three implementation differences, each read from
    its code (docs/planner.md section 6): its gradient path is the planner's `grad_accumulation_fusion`; its
    vocab-parallel loss keeps a new fp32 copy of the logits while the bf16 ones live (+2 bytes per logit); and
    cuBLAS workspaces come from the caching allocator: PyTorch's (aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB
    on Hopper or under CUBLAS_WORKSPACE_CONFIG=:4096:8, else 8 MiB + 128 KiB) and Transformer Engine's
    (`get_cublas_workspace_size_bytes`: 4 MiB before Hopper, 32 MiB on Hopper)."""
    deg, job = Degrees(**row["degrees"]), Job(**row["job"])
    vocab = -(-50257 // (128 * deg.tp)) * 128 * deg.tp
    model = gpt(8, 512, 12, vocab, row["dropout"], 1024)
    planned = stage_memory(model, deg, replace(job, grad_accumulation_fusion=True), deg.pp - 1)
    logits = job.micro_batch * (job.seq_len // deg.cp) * (vocab // deg.tp)
    mib, hopper = 1024**2, row["gpu"] == "h100"
    torch_workspace = 32 * mib if hopper or row["cublas_config"] else 8 * mib + 128 * 1024
    te_workspace = (32 if hopper else 4) * mib if row["te"] else 0
    return planned["total"] + 2 * logits + torch_workspace + te_workspace


def fsdp_freed_gib(_row: dict) -> float:
    """What ZeRO-3 with fp32 shards (FSDP2's default) frees on Llama 3.1 8B going from 8 to 128 ranks at the same
    local batch: torchtitan's difference cancels its loss and allocator cache, which the planner does not price."""
    model, job = load_model("llama3-8b"), Job(seq_len=8192, micro_batch=2, zero_stage=3, param_dtype="float32")
    return (memory_per_gpu(model, Degrees(dp=8), job)["total"]
            - memory_per_gpu(model, Degrees(dp=128), job)["total"]) / 2**30


PRICE_MEMORY = {"zero-model-states": zero_model_states_gb, "megatron-ci": megatron_peak, "fsdp-freed": fsdp_freed_gib}


def memory_error(row: dict) -> float:
    return PRICE_MEMORY[row["kind"]](row) / row["published"] - 1


def _memory_rows(kind: str) -> list[dict]:
    return [m for m in MEMORY if m["kind"] == kind]


@pytest.mark.parametrize("row", _memory_rows("zero-model-states"), ids=lambda m: m["name"])
def test_model_states_within_10_percent_of_zero_table_1(row):
    assert abs(memory_error(row)) <= 0.10


MEGATRON_CI = _memory_rows("megatron-ci")


@pytest.mark.parametrize("row", MEGATRON_CI, ids=[m["name"].split(" ")[0] + "-" + m["gpu"] for m in MEGATRON_CI])
def test_peak_memory_within_10_percent_of_megatron_ci(row):
    assert abs(memory_error(row)) <= 0.10


@pytest.mark.parametrize("row", _memory_rows("fsdp-freed"), ids=lambda m: m["name"])
def test_fsdp_memory_freed_from_8_to_128_gpus_within_10_percent_of_torchtitan(row):
    assert abs(memory_error(row)) <= 0.10


# ---- the report -----------------------------------------------------------------------------------------------
def _goal(label: str, value: float, limit: float) -> tuple[str, bool]:
    holds = value <= limit
    return f"goal {label}: {100 * value:.1f}% (<= {100 * limit:.0f}%: {'holds' if holds else 'NOT MET'})", holds


def test_report_in_sample_and_out_of_sample_side_by_side(scored):
    memory = [validation.Scored(m["name"], "memory", m["split"], m["added"], memory_error(m)) for m in MEMORY]
    not_fitting = [r.name for r in RUNS if not validation.fitting_jobs(r)]
    _, mean, worst = validation.summary(scored, "validation")
    class_means = {c: validation.summary(scored, "validation", c)[1] for c in validation.CLASSES}
    goals = [_goal("out-of-sample throughput mean", mean, 0.12), _goal("out-of-sample throughput worst", worst, 0.30),
             *(_goal(f"out-of-sample {c} mean", m, 0.20) for c, m in class_means.items()),
             _goal("out-of-sample memory mean", validation.summary(memory, "validation")[1], 0.10)]
    print("\n" + "\n".join(validation.side_by_side(scored, LAST_REFIT, "throughput")))
    print("\n".join(validation.side_by_side(memory, LAST_REFIT, "memory")))
    print("\n".join(line for line, _ in goals))
    print(f"goal no published layout that ran reported as not fitting: {len(not_fitting)} are "
          f"({'; '.join(not_fitting)})")
    rows = reserved.load_reserved()
    peaks = [validation.Scored(r.name, "reserved", r.split, r.added, reserved.reserved_error(r))
             for r in rows if r.metric == "reserved_gib"]
    print("\n".join(validation.side_by_side(peaks, LAST_REFIT, "reserved memory")))
    peaks_not_fitting = [r.name for r in rows if r.metric == "reserved_gib" and not reserved.judged_fitting(r)]
    print(f"  and of the {len(peaks)} layouts with a published reserved peak, {len(peaks_not_fitting)} are "
          f"({'; '.join(peaks_not_fitting)})")
    oom = [r for r in rows if r.metric == "oom"]
    oom_fitting = [r.name for r in oom if reserved.judged_fitting(r)]
    print(f"goal layouts published as out of memory reported as not fitting: {len(oom) - len(oom_fitting)} of "
          f"{len(oom)} are" + (f" (reported as fitting: {'; '.join(oom_fitting)})" if oom_fitting else ""))
    # Asserted: the goals that hold now (the four dense classes, memory, every reserved-peak layout fitting), and
    # bands on what does not: the in-sample mean, and the count of published layouts the planner says do not fit,
    # which may only fall from here. It fell from 19 to 5 when the fit check began to count the share of
    # fragmentation the allocator keeps when short of memory rather than the share it reserves with room to spare
    # (docs/planner.md, section 3), to 4 when DeepSeek-V3's own recompute and FP8 activations were priced, and to
    # 2 when Llama 3's FSDP sharded gradients and optimizer states as its paper says, and to 1 when NeMo's GPT-3
    # 20B accumulated its gradients in bf16 as its script says; the 1 (Llama 3 405B on 8192 GPUs) needs 1.30x its
    # GPU.
    for cls in ("fully sharded", "long context", "pipeline", "size"):
        assert class_means[cls] <= 0.20, cls
    assert validation.summary(memory, "validation")[1] <= 0.10
    assert validation.summary(scored, "calibration")[1] <= 0.08
    # Not met, banded where the fitted host pacing of MoE layers and the fit check left them (docs/planner.md,
    # section 6): layouts with unpublished knobs that now fit closer to the edge are priced faster.
    assert class_means["moe"] <= 0.39 and mean <= 0.145
    assert len(not_fitting) <= 1
    assert not oom_fitting and not peaks_not_fitting


def test_a_tuned_virtual_stage_count_brings_its_schedule():
    """Tuning an interleaved row's virtual stages down to one gives 1F1B (interleaving one chunk is refused), and
    up from one gives the interleaved schedule; a knob other than virtual stages leaves the schedule."""
    interleaved = Job(seq_len=8, pp_schedule="interleaved", virtual_stages=4)
    one = validation._turned(interleaved, "virtual_stages", 1)
    assert (one.pp_schedule, one.virtual_stages) == ("1f1b", 1)
    two = validation._turned(Job(seq_len=8), "virtual_stages", 2)
    assert (two.pp_schedule, two.virtual_stages) == ("interleaved", 2)
    assert validation._turned(interleaved, "micro_batch", 2).pp_schedule == "interleaved"
    assert validation._turned(Job(seq_len=8, pp_schedule="gpipe"), "virtual_stages", 1).pp_schedule == "gpipe"
