"""`orangetron estimate` / `orangetron plan`: JSON contract, ranked table, one-line errors with exit 2."""

import json
import sys
from dataclasses import replace

import pytest

from orangetron.cli import main as run
from orangetron.plan.chart import sharding_label
from orangetron.spec.options import Job


def last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_estimate_json_contract(capsys):
    code = run(["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "16", "--tp", "2", "--seq", "8192",
                "--micro-batch", "1", "--global-batch", "32", "--sequence-parallel", "--distributed-optimizer",
                "--json"])
    assert code == 0
    data = last_json(capsys)
    assert set(data["memory_bytes"]) >= {"params", "grads", "main_params", "optimizer", "activations", "total"}
    assert data["layout"]["dp"] == 8
    assert data["comm_bytes"]["reduce_scatter/dp_cp"] > 0 and "all_gather/tp" in data["comm_bytes"]
    assert data["step_time_s"] > 0 and 0 < data["mfu"] < 1 and data["tflops_per_gpu"] > 0


# The `job` object's keys, in order, as `estimate --json` has always printed them (a contract with its readers).
JOB_KEYS = ["seq_len", "micro_batch", "global_batch", "num_microbatches", "bucket_numel", "clip_grad",
            "sequence_parallel", "cp_mode", "ulysses_degree", "dispatcher", "capacity_factor", "ep_overlap_chunks",
            "ep_comm_sms", "ep_comm_sms_reserved", "zero_stage", "distributed_optimizer", "zero3_prefetch",
            "zero3_keep_params", "zero3_reduce_every_microbatch", "param_dtype", "grad_dtype", "reduce_dtype",
            "pp_schedule", "virtual_stages", "pipeline_layout", "recompute", "recompute_layers", "attention_kernel",
            "overlap_ep", "overlap_grad_reduce", "grad_accumulation_fusion", "fp8", "fp8_recipe",
            "optimizer_state_dtype", "tp_sum_with_reduction", "accumulate_in_reduce_dtype", "eager_fp32_loss",
            "recompute_modules", "fp8_cached_activations", "overlap_shared_experts", "tp_comm_overlap"]


def test_estimate_json_job_keeps_its_published_keys(capsys):
    """The job's options carry the runtime's names (`microbatches`, `grad_bucket_numel`, `reduce_dtype` None);
    the published object keeps its own keys, order and "" for the parameters' reduction dtype, and reads back."""
    args = ["estimate", "--model", "llama3-8b", "--tp", "2", "--pp", "2", "--dp", "2", "--global-batch", "8",
            "--grad-bucket-numel", "40000000", "--json"]
    run(args)
    job = last_json(capsys)["job"]
    assert list(job) == JOB_KEYS
    # num_microbatches: the micro-batches per step as priced, which the global batch sets (8 over dp 2).
    assert (job["num_microbatches"], job["bucket_numel"], job["reduce_dtype"], job["pipeline_layout"]) == \
        (4, 40_000_000, "", [])
    read_back = Job.from_json(job)  # and reads back as the job that was priced
    assert (read_back.grad_bucket_numel, read_back.reduce_dtype, read_back.to_json()) == (40_000_000, None, job)
    run([*args, "--reduce-dtype", "float32"])
    assert last_json(capsys)["job"]["reduce_dtype"] == "float32"
    assert Job(seq_len=8, microbatches=3).to_json()["num_microbatches"] == 3
    with pytest.raises(ValueError, match="job keys microbatches: not keys of the published job object"):
        Job.from_json({**job, "microbatches": 3})


def test_estimate_grad_bucket_numel_frees_each_grad_on_arrival(capsys):
    """Llama 3 8B (8,030,261,248 parameters, bf16) on dp=8: unbucketed, every .grad waits for the reduction;
    with buckets each one is added into the main buffer as it arrives, the largest being the 128256 x 4096
    embedding (or output) matrix."""
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--dp", "8", "--seq", "4096", "--json"]
    run(args)
    assert last_json(capsys)["memory_bytes"]["param_grads"] == 8_030_261_248 * 2
    run([*args, "--grad-bucket-numel", "40000000"])
    assert last_json(capsys)["memory_bytes"]["param_grads"] == 128256 * 4096 * 2



def test_estimate_grad_accumulation_fusion(capsys):
    """Llama 3 8B on tp2 x dp4 with SP and the distributed optimizer. orangetron's runtime sums the SP norms'
    partial gradients over tp before the dp reduction, so it keeps every .grad until the step and concatenates
    the partials out of place; Megatron-Core adds each gradient into its main-gradient buffer as it arrives and
    reduces there: one .grad at a time (the largest, this rank's 64128 x 4096 half of the embedding or output
    layer), no reduction buffers, and the reduce-scatter in the buffer's own fp32 where the runtime sends a bf16
    copy (twice the bytes; everything else on the wire the same)."""
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--tp", "2", "--dp", "4", "--sequence-parallel",
            "--distributed-optimizer", "--grad-bucket-numel", "40000000", "--seq", "4096", "--json"]
    run(args)
    runtime = last_json(capsys)
    run([*args, "--grad-accumulation-fusion"])
    fused = last_json(capsys)
    norms = 65 * 4096  # two per layer and the final one, whole on both tp ranks
    assert runtime["memory_bytes"]["param_grads"] == ((8_030_261_248 - norms) // 2 + norms) * 2
    assert runtime["memory_bytes"]["grad_buckets"] > 0
    assert fused["memory_bytes"]["param_grads"] == 64128 * 4096 * 2
    assert fused["memory_bytes"]["grad_buckets"] == 0
    rs = "reduce_scatter/dp_cp"
    assert fused["comm_bytes"][rs] == 2 * runtime["comm_bytes"][rs]
    assert {k: v for k, v in fused["comm_bytes"].items() if k != rs} == \
        {k: v for k, v in runtime["comm_bytes"].items() if k != rs}


def test_grad_accumulation_fusion_needs_a_whole_main_gradient_buffer_reduced_in_its_dtype():
    for stage in (2, 3):
        with pytest.raises(ValueError, match="grad_accumulation_fusion with zero_stage"):
            Job(seq_len=8, zero_stage=stage, grad_accumulation_fusion=True)
    with pytest.raises(ValueError, match="reduced where it lies, in its own dtype"):
        Job(seq_len=8, grad_accumulation_fusion=True, reduce_dtype="bfloat16")
    assert Job(seq_len=8, grad_accumulation_fusion=True, reduce_dtype="float32").reduce_bytes == 4
    assert Job(seq_len=8, grad_accumulation_fusion=True, grad_dtype="bfloat16").reduce_bytes == 2


def test_estimate_prices_usp(capsys):
    """Llama 3 8B (32 layers) on tp2 x cp4 with Ulysses over 2 ranks and a ring over 2: per layer, forward and
    backward each send Q, K+V and the output through one all-to-all (3 x 2 x 32 = 192 calls), and the ring passes
    K,V once forward and once backward, then returns dK,dV over both hops ((2 - 1) x 2 + 2 = 4 x 32 = 128)."""
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--cp", "4", "--seq", "8192",
                "--sequence-parallel", "--cp-mode", "usp", "--ulysses-degree", "2", "--json"]) == 0
    comm = last_json(capsys)["comm"]
    assert comm["all_to_all/cp_ulysses"]["calls"] == 192
    assert comm["send_recv/cp_ring"]["calls"] == 128


def test_estimate_without_shared_expert_overlap_exposes_the_all_to_all(capsys):
    """DeepSeek-V2 (2 shared experts per MoE layer), ep 8, no paired micro-batches: its shared experts hide the
    all-to-all (all but the contention share) unless --no-overlap-shared-experts says they wait for it, as
    Megatron-Core runs them by default; then only the exposed all-to-all grows, and the flag reaches the JSON."""
    args = ["estimate", "--model", "deepseek-v2", "--gpus", "64", "--dp", "64", "--ep", "8", "--seq", "4096",
            "--no-overlap-ep", "--json"]
    run(args)
    beside = last_json(capsys)
    run([*args, "--no-overlap-shared-experts"])
    alone = last_json(capsys)
    assert (beside["job"]["overlap_shared_experts"], alone["job"]["overlap_shared_experts"]) == (True, False)
    assert alone["comm"] == beside["comm"]
    grown = alone["time_breakdown_s"]["ep_s"] - beside["time_breakdown_s"]["ep_s"]
    assert grown > 5 * beside["time_breakdown_s"]["ep_s"] > 0
    assert alone["step_time_s"] - beside["step_time_s"] == pytest.approx(grown)


def test_estimate_prices_chunked_expert_overlap(capsys):
    """Mixtral 8x7B (32 MoE layers) on 16 GPUs in nodes of 4, ep 8 across nodes, no paired micro-batches. Per
    layer the ragged dispatcher exchanges counts once, then forward sends rows, ids, weights and the combine
    (4 all-to-alls) and backward 3, per chunk: 1 + 7 = 8 calls, or 1 + 14 = 15 with two chunks (256 and 480
    per step). The second chunk's transfers hide behind the first chunk's experts: less exposed time."""
    args = ["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--dp", "16", "--ep", "8", "--gpus-per-node", "4",
            "--seq", "4096", "--no-overlap-ep", "--json"]
    run(args)
    one = last_json(capsys)
    run([*args, "--ep-overlap-chunks", "2"])
    two = last_json(capsys)
    assert one["comm"]["all_to_all/ep"]["calls"] == 32 * 8
    assert two["comm"]["all_to_all/ep"]["calls"] == 32 * 15
    assert two["time_breakdown_s"]["ep_s"] < 0.75 * one["time_breakdown_s"]["ep_s"]

def test_estimate_zero3_reduce_every_microbatch(capsys):
    """Llama 3 8B, ZeRO-3 on dp=8, 4 micro-batches per step: reduce-scattering every micro-batch moves 4 times the
    gradient bytes and holds one unit's .grad at a time, the largest being the head (final norm of 4096 and the
    128256 x 4096 output layer, whose gradient arrives first and waits for the norm's), instead of every
    parameter's."""
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--dp", "8", "--seq", "4096", "--zero-stage", "3",
            "--micro-batch", "1", "--global-batch", "32", "--json"]
    run(args)
    once = last_json(capsys)
    run([*args, "--zero3-reduce-every-microbatch"])
    every = last_json(capsys)
    rs = "reduce_scatter/dp_cp"
    assert every["comm_bytes"][rs] == 4 * once["comm_bytes"][rs]
    assert once["memory_bytes"]["param_grads"] == 8_030_261_248 * 2
    assert every["memory_bytes"]["param_grads"] == (128256 * 4096 + 4096) * 2


def test_estimate_prices_the_zero3_prefetch_and_kept_parameters(capsys):
    """`estimate` takes `train`'s ZeRO-3 switches: without prefetch every gather waits (more exposed dp time),
    kept parameters gather once a micro-batch instead of twice."""
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--dp", "8", "--seq", "4096", "--zero-stage", "3",
            "--global-batch", "32", "--json"]
    run(args)
    base = last_json(capsys)
    run([*args, "--no-zero3-prefetch"])
    no_prefetch = last_json(capsys)
    run([*args, "--zero3-keep-params"])
    kept = last_json(capsys)
    assert (base["job"]["zero3_prefetch"], no_prefetch["job"]["zero3_prefetch"], kept["job"]["zero3_keep_params"]) \
        == (True, False, True)
    assert no_prefetch["time_breakdown_s"]["dp_s"] > base["time_breakdown_s"]["dp_s"]
    assert 2 * kept["comm_bytes"]["all_gather/dp_cp"] == base["comm_bytes"]["all_gather/dp_cp"]


def test_estimate_says_when_reducing_every_micro_batch_changes_nothing(capsys):
    """With sequence parallelism the partial gradients are summed over tp first and every reduction waits for
    the step: the switch changes nothing, and `estimate` says so on standard error."""
    args = ["estimate", "--model", "llama3-8b", "--tp", "2", "--dp", "4", "--seq", "4096", "--zero-stage", "3",
            "--global-batch", "16", "--zero3-reduce-every-microbatch", "--json"]
    run([*args, "--sequence-parallel"])
    err = capsys.readouterr().err
    assert "zero3_reduce_every_microbatch has no effect" in err and "partial ones over tp under sequence" in err
    run(args)
    assert "no effect" not in capsys.readouterr().err
    run([a if a != "16" else "4" for a in args])  # one micro-batch a replica
    assert "no effect here: a replica runs one micro-batch" in capsys.readouterr().err


def test_plan_does_not_rank_a_reduction_every_micro_batch_that_changes_nothing(capsys):
    """Under sequence parallelism (or one micro-batch) "zero3-mb" is the same step as "zero3": not ranked twice."""
    from orangetron.plan.params import tp_sums_first
    from orangetron.plan.search import SearchSpace, search
    from orangetron.spec.hardware import make_cluster
    from orangetron.spec.model import load_model

    model = load_model("llama3-8b")
    space = SearchSpace(tp=(1, 2), cp=(1,), pp=(1,), zero=("zero3", "zero3-mb"), micro_batch=(1,),
                        virtual_stages=(1,), recompute=("none", "full"))
    ranked = search(model, make_cluster("h100", 8), 4096, 16, space=space, top=50).ranked
    every = [e for e in ranked if e.job.zero3_reduce_every_microbatch]
    assert every and [e for e in ranked if tp_sums_first(model, e.degrees, e.job)]  # both kinds of layout ranked
    assert not [e for e in every if tp_sums_first(model, e.degrees, e.job)]


def test_estimate_prices_adam_moments_in_a_narrower_dtype(capsys):
    """Llama 3 8B (8,030,261,248 parameters) with the distributed optimizer over dp 8: Adam's two moments take
    2 x 4 bytes per parameter of the shard in fp32, 2 x 2 in bfloat16 (Megatron-Core's precision-aware
    optimizer); nothing else changes, and the optimizer step reads and writes fewer bytes."""
    args = ["estimate", "--model", "llama3-8b", "--dp", "8", "--seq", "4096", "--distributed-optimizer", "--json"]
    run(args)
    fp32 = last_json(capsys)
    run([*args, "--optimizer-state-dtype", "bfloat16"])
    bf16 = last_json(capsys)
    shard = -(-8_030_261_248 // 8)
    assert (fp32["memory_bytes"]["optimizer"], bf16["memory_bytes"]["optimizer"]) == (8 * shard, 4 * shard)
    same = {k for k in fp32["memory_bytes"] if k not in ("optimizer", "total", "overhead", "needed")}
    assert {k: bf16["memory_bytes"][k] for k in same} == {k: fp32["memory_bytes"][k] for k in same}
    assert (fp32["job"]["optimizer_state_dtype"], bf16["job"]["optimizer_state_dtype"]) == ("", "bfloat16")
    assert bf16["time_breakdown_s"]["optimizer_s"] < fp32["time_breakdown_s"]["optimizer_s"]
    assert Job.from_json(bf16["job"]).optimizer_state_dtype == "bfloat16"


def test_adam_moments_move_what_their_width_says(tmp_path, capsys):
    """The optimizer step's bytes follow the moments' width against the main parameters': float64 parameters
    with float64 moments (their default) step as without the option, float32 moments faster. `estimate
    --config` takes the planner-only option from the command line as `estimate` does."""
    args = ["estimate", "--model", "tiny", "--dp", "2", "--seq", "64", "--param-dtype", "float64",
            "--distributed-optimizer", "--json"]
    times = {}
    for dtype in (None, "float64", "float32"):
        run([*args, *(("--optimizer-state-dtype", dtype) if dtype else ())])
        result = last_json(capsys)
        times[dtype] = (result["time_breakdown_s"]["optimizer_s"], result["memory_bytes"]["optimizer"])
    assert times["float64"] == times[None]
    assert times["float32"][0] < times[None][0] and 2 * times["float32"][1] == times[None][1]
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny"\nseq_len = 64\ndp = 2\ndistributed_optimizer = true\n')
    run(["estimate", "--config", str(config), "--json"])
    plain = last_json(capsys)["memory_bytes"]["optimizer"]
    run(["estimate", "--config", str(config), "--optimizer-state-dtype", "bfloat16", "--json"])
    narrow = last_json(capsys)
    assert narrow["job"]["optimizer_state_dtype"] == "bfloat16" and 2 * narrow["memory_bytes"]["optimizer"] == plain


def test_estimate_prices_the_framework_paths(tmp_path, capsys):
    """`--tp-sum-with-reduction` frees each `.grad` under SP instead of keeping them all to the step,
    `--eager-fp32-loss` adds two fp32 logit copies to the activations, `--accumulate-in-reduce-dtype` widens
    ZeRO-3 gradients that wait across micro-batches; each is printed in the job and read back, and `estimate
    --config` takes them from its flags too."""
    args = ["estimate", "--model", "tiny", "--tp", "2", "--sequence-parallel", "--dp", "2", "--seq", "64",
            "--global-batch", "8", "--grad-bucket-numel", "4096", "--json"]
    run(args)
    plain = last_json(capsys)
    flags = {"--tp-sum-with-reduction": "tp_sum_with_reduction", "--eager-fp32-loss": "eager_fp32_loss"}
    out = {}
    for flag, key in flags.items():
        run([*args, flag])
        out[key] = last_json(capsys)
        assert out[key]["job"][key] is True and plain["job"][key] is False
        assert getattr(Job.from_json(out[key]["job"]), key)
    assert out["tp_sum_with_reduction"]["memory_bytes"]["param_grads"] < plain["memory_bytes"]["param_grads"]
    from orangetron.spec.model import load_model

    vocab_tokens = 64 * load_model("tiny").vocab_size // 2  # one micro-batch of one sequence, vocab over tp 2
    extra = out["eager_fp32_loss"]["memory_bytes"]["activations"] - plain["memory_bytes"]["activations"]
    assert extra == 2 * 4 * vocab_tokens
    zero3 = ["estimate", "--model", "tiny", "--dp", "2", "--seq", "64", "--global-batch", "8", "--zero-stage", "3",
             "--reduce-dtype", "float32", "--json"]
    run(zero3)
    narrow = last_json(capsys)["memory_bytes"]["param_grads"]
    run([*zero3, "--accumulate-in-reduce-dtype"])
    assert last_json(capsys)["memory_bytes"]["param_grads"] == 2 * narrow  # bf16 -> fp32
    run([a for a in zero3 if a not in ("--reduce-dtype", "float32")] + ["--accumulate-in-reduce-dtype"])
    assert "--accumulate-in-reduce-dtype has no effect here" in capsys.readouterr().err  # bf16 reductions
    run([*zero3, "--tp-sum-with-reduction"])
    assert "--tp-sum-with-reduction has no effect here" in capsys.readouterr().err  # tp 1: nothing to sum
    run([*args, "--tp-sum-with-reduction"])
    assert "has no effect" not in capsys.readouterr().err
    # a tied embedding under pp: the copies' sum moves after the reduction, priced in the main gradients' dtype
    tied = ["estimate", "--model", "gpt3-175b", "--gpus", "64", "--tp", "8", "--pp", "8", "--global-batch", "64",
            "--grad-bucket-numel", "40000000", "--json"]
    run(tied)
    held = last_json(capsys)
    run([*tied, "--tp-sum-with-reduction"])
    after = last_json(capsys)
    assert "has no effect" not in capsys.readouterr().err
    assert after["comm_bytes"]["all_reduce/pp"] == 2 * held["comm_bytes"]["all_reduce/pp"]  # fp32, not bf16
    assert after["memory_bytes"]["param_grads"] < held["memory_bytes"]["param_grads"]  # bucketed: no .grad waits
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny"\nseq_len = 64\ntp = 2\ndp = 2\nsequence_parallel = true\n'
                      'grad_bucket_numel = 4096\n')
    run(["estimate", "--config", str(config), "--json"])
    from_file = last_json(capsys)["memory_bytes"]
    run(["estimate", "--config", str(config), "--tp-sum-with-reduction", "--eager-fp32-loss", "--json"])
    priced = last_json(capsys)
    assert priced["job"]["tp_sum_with_reduction"] is True and priced["job"]["eager_fp32_loss"] is True
    assert priced["memory_bytes"]["param_grads"] < from_file["param_grads"]
    assert priced["memory_bytes"]["activations"] > from_file["activations"]
    run(["estimate", "--config", str(config), "--no-overlap-grad-reduce", "--grad-accumulation-fusion", "--json"])
    job = last_json(capsys)["job"]
    assert job["overlap_grad_reduce"] is False and job["grad_accumulation_fusion"] is True  # planner-only: read
    assert run(["estimate", "--config", str(config), "--tp", "4", "--reduce-dtype", "float32"]) == 2
    assert "--tp --reduce-dtype would be ignored" in capsys.readouterr().err  # the file's: refused by name
    assert run(["estimate", "--config", str(config), "--param-dtype", "bfloat16", "--micro-batch=1"]) == 2
    assert "--param-dtype --micro-batch would be ignored" in capsys.readouterr().err  # at their defaults too
    for line, needle in (("seq_len = 64\nsteps = -5", "steps=-5 (--steps): must be a positive integer"),
                         ("seq_len = 4096", "seq_len=4096 is longer than the model's max_seq_len=1024")):
        bad = tmp_path / "bad.toml"  # train refuses both
        bad.write_text(config.read_text().replace("seq_len = 64", line))
        assert run(["estimate", "--config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"--config {bad}: {needle}" in err and len(err.strip().splitlines()) == 1, err
    low = tmp_path / "low.toml"
    low.write_text(config.read_text() + "lr = 1e-4\n")  # train's floor follows lr (a tenth), not min_lr's 2e-4
    assert run(["estimate", "--config", str(low)]) == 0, capsys.readouterr().err


def test_estimate_prices_the_tensor_parallel_overlap_and_the_trainer_refuses_it(tmp_path, capsys):
    """`--tp-comm-overlap` hides tp traffic behind the GEMMs (no other part of the step moves), prints it in
    the job and the options line, is read by `estimate --config` from its flags, needs sequence parallelism,
    and is a plan the trainer does not run."""
    from orangetron.cli.run_config import emit_config
    from orangetron.plan.estimate import estimate
    from orangetron.spec.hardware import load_gpu, make_cluster
    from orangetron.spec.model import load_model
    from orangetron.spec.options import Degrees

    args = ["estimate", "--model", "llama3-8b", "--tp", "4", "--sequence-parallel", "--dp", "2", "--seq", "4096",
            "--global-batch", "8", "--json"]
    run(args)
    blocking = last_json(capsys)
    run([*args, "--tp-comm-overlap"])
    overlapped = last_json(capsys)
    assert (blocking["job"]["tp_comm_overlap"], overlapped["job"]["tp_comm_overlap"]) == (False, True)
    before, after = blocking["time_breakdown_s"], overlapped["time_breakdown_s"]
    assert 0 < after["tp_s"] < 0.5 * before["tp_s"]
    assert {k: v for k, v in after.items() if k not in ("tp_s", "step_s")} == {
        k: v for k, v in before.items() if k not in ("tp_s", "step_s")}
    run([*args[:-1], "--tp-comm-overlap"])
    assert "--tp-comm-overlap" in capsys.readouterr().out.split("options: ")[1].splitlines()[0]
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny"\nseq_len = 64\ntp = 2\ndp = 2\nsequence_parallel = true\n')
    run(["estimate", "--config", str(config), "--tp-comm-overlap", "--json"])
    assert last_json(capsys)["job"]["tp_comm_overlap"] is True
    assert run(["estimate", "--model", "llama3-8b", "--tp", "4", "--dp", "2", "--tp-comm-overlap"]) == 2
    err = capsys.readouterr().err
    assert "tp_comm_overlap=True (--tp-comm-overlap) needs sequence_parallel=True (--sequence-parallel)" in err
    assert len(err.strip().splitlines()) == 1
    row = estimate(load_model("tiny"), Degrees(tp=2, dp=2), Job(seq_len=64, sequence_parallel=True,
                                                                 tp_comm_overlap=True),
                   make_cluster(load_gpu("h100"), 4))
    with pytest.raises(ValueError, match=r"tp_comm_overlap=True: the trainer runs False only\)"):  # no plan flag
        emit_config([row], str(tmp_path / "plan.toml"))


def test_plan_keeps_a_given_pipeline_layout(capsys):
    """`plan --pipeline-layout` ranks only layouts with that split: pp a divisor of its 16 virtual stages (here
    the 2 GPUs allow only 2, so 8 virtual stages, beyond the searched 1, 2, 4), each row priced as `estimate`
    prices it; a layout of the wrong layer count, or one no pipeline degree fits, is refused in one line."""
    args = ["plan", "--model", "llama3-8b", "--gpus", "2", "--seq", "2048", "--global-batch", "16",
            "--pipeline-layout", "1,3x14,0", "--top", "3"]
    assert run(args) == 2
    assert "holds 43 layers; llama3-8b has 32" in capsys.readouterr().err
    args[-3] = "2x16"
    assert run([*args, "--json"]) == 0
    ranked = last_json(capsys)["ranked"]
    assert ranked and all(r["job"]["pipeline_layout"] == [2] * 16 for r in ranked)
    assert all((r["layout"]["pp"], r["job"]["virtual_stages"]) == (2, 8) for r in ranked)
    best = ranked[0]
    layout, job = best["layout"], best["job"]
    run(["estimate", "--model", "llama3-8b", "--gpus", "2", "--seq", "2048", "--global-batch", "16",
         "--pp", "2", "--dp", "1", "--tp", str(layout["tp"]), "--cp", str(layout["cp"]),
         "--virtual-stages", "8", "--pipeline-layout", "2x16", "--micro-batch", str(job["micro_batch"]),
         "--recompute", job["recompute"], "--recompute-layers", str(job["recompute_layers"]),
         "--zero-stage", str(job["zero_stage"]), *(["--distributed-optimizer"] if job["distributed_optimizer"] else []),
         *(["--zero3-reduce-every-microbatch"] if job["zero3_reduce_every_microbatch"] else []),
         *(["--sequence-parallel"] if job["sequence_parallel"] else []), "--cp-mode", job["cp_mode"], "--json"])
    assert last_json(capsys)["step_time_s"] == pytest.approx(best["step_time_s"])
    assert run([*args[:-3], "2x15,1,1", "--top", "3"]) == 2
    assert "has 17 virtual stages: pp must divide both them and 2 GPUs" in capsys.readouterr().err
    assert run([*args[:-3], "2x16", "--pp", "2", "--pp-schedule", "1f1b"]) == 2  # one chunk a rank: pp 16 only
    assert "(of --pp) must divide both them and 2 GPUs" in capsys.readouterr().err


def test_plan_emits_a_layout_only_where_it_is_the_even_split(tmp_path, capsys):
    """The trainer runs the even split only: a given layout equal to it is emitted (as the even split), another
    is passed over by name."""
    args = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch", "8", "--param-dtype",
            "float32", "--top", "2"]
    even = tmp_path / "even.toml"
    assert run([*args, "--pipeline-layout", "1,1", "--emit-config", str(even)]) == 0
    assert "pp = 2" in even.read_text() and "pipeline_layout" not in even.read_text()
    capsys.readouterr()
    assert run([*args, "--pipeline-layout", "2,0", "--emit-config", str(tmp_path / "uneven.toml")]) == 2
    assert "pipeline_layout=[2, 0]: the trainer runs only the even split" in capsys.readouterr().err


def test_estimate_text_report(capsys):
    assert run(["estimate", "--model", "mixtral-8x7b", "--gpus", "64", "--ep", "8", "--tp", "2",
                "--sequence-parallel", "--zero-stage", "1", "--seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "all_to_all/ep" in out and "MFU" in out
    # The transient categories `buffers` sums are shown under it, each on its own line.
    assert run(["estimate", "--model", "llama3-8b", "--dp", "8", "--seq", "4096", "--zero-stage", "3",
                "--global-batch", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["buffers"])
    parts = {line.split()[0]: float(line.split()[1]) for line in lines[at + 1:at + 4]}
    assert set(parts) == {"gathered_params", "grad_buckets", "param_grads"}
    assert sum(parts.values()) == pytest.approx(float(lines[at].split()[1]), abs=0.02)


def test_estimate_from_toml_file(tmp_path, capsys):
    path = tmp_path / "tiny.toml"
    path.write_text("hidden_size = 512\nnum_layers = 4\nnum_heads = 8\nffn_hidden_size = 1024\nvocab_size = 1000\n")
    assert run(["estimate", "--model", str(path), "--gpu", "rtx3090", "--gpus", "2", "--seq", "1024", "--json"]) == 0
    assert last_json(capsys)["model"] == "tiny"


@pytest.mark.parametrize(("argv", "needle"), [
    (["estimate", "--model", "llama-9000"], "unknown model preset"),
    (["estimate", "--model", "llama3-8b", "--gpu", "tpu-v9"], "unknown gpu preset"),
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "3"], "divisible"),
    # without --gpus: the heads rule, not "gpus=12 (--gpus) is not a multiple of gpus_per_node=8"
    (["estimate", "--model", "tiny-moe", "--tp", "3", "--dp", "4", "--seq", "64"], "tp=3 (--tp): n_heads=4 is not"),
    (["estimate", "--model", "llama3-8b", "--tp", "2", "--dp", "6"],
     "the layout's 12 GPUs (tp*cp*pp*dp) are not whole nodes of 8: give degrees"),
    (["schedule", "--pp", "4", "--microbatches", "2", "--schedule", "interleaved"],
     "pp_schedule='interleaved' (--schedule) with virtual_stages=1"),  # the command's own flag, not train's
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--dp", "3"],
     "--gpus=8 but tp*cp*pp*dp = 6; leave --dp out (dp then takes the GPUs tp*cp*pp leaves) or give --gpus 6"),
    # (under cp such a length is priced padded, as train pads it: `test_plan_to_train.py`)
    (["estimate", "--model", "llama3-8b", "--tp", "2", "--sequence-parallel", "--seq", "1001"],
     "sequence_parallel needs seq_len/cp=1001 divisible by tp"),
    (["estimate", "--model", "llama3-8b", "--ep", "2", "--dp", "2"], "no experts"),
    (["estimate", "--model", "llama3-8b", "--gpus", "0"], "must be >= 1"),
    # priced before as a negative step time, or a 0 taken for the default
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "-8"], "--global-batch=-8: must be >= 1"),
    (["estimate", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "0"], "--global-batch=0: must be >= 1"),
    (["estimate", "--model", "llama3-8b", "--gpus", "16", "--nic-gbps", "-5"], "--nic-gbps=-5.0: must be > 0"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "-64"], "--global-batch=-64: must be >= 1"),
    (["plan", "--model", "llama3-8b", "--gpus", "16", "--nic-gbps", "0"], "--nic-gbps=0.0: must be > 0"),
    (["estimate", "--model", "llama3-8b", "--overhead-gib", "-1"], "--overhead-gib=-1.0: must be >= 0"),
    # infinity gave a traceback, NaN a message without the flag
    (["estimate", "--model", "llama3-8b", "--overhead-gib", "inf"], "--overhead-gib=inf: must be >= 0 and finite"),
    (["estimate", "--model", "llama3-8b", "--overhead-gib", "nan"], "--overhead-gib=nan: must be >= 0 and finite"),
    (["estimate", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "8", "--dispatcher", "capacity",
      "--capacity-factor", "inf"], "capacity_factor=inf (--capacity-factor): must be positive and finite"),
    (["estimate", "--model", "llama3-8b", "--overhead-fraction", "-0.5"], "--overhead-fraction=-0.5: must be >= 0"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--overhead-fraction", "1"], "--overhead-fraction=1.0: must"),
    (["estimate", "--model", "clip-vit-bigg14"], "error: model clip-vit-bigg14 is a dual encoder"),
    (["estimate", "--model", "missing.toml"], "does not exist"),
    (["plan", "--model", "llama3-405b", "--gpus", "8", "--seq", "8192"], "no layout"),
    (["plan", "--model", "llama3-8b", "--gpus", "64", "--tp", "3"], "has --tp 3"),
    # a fraction above 1 admitted layouts the GPU cannot hold
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--memory-fraction", "1.5"], "--memory-fraction=1.5: must be"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--memory-fraction", "0"], "--memory-fraction=0.0: must be"),
    # the spec's rules name a field; estimate names the flag that sets it
    (["estimate", "--model", "llama3-8b", "--pp", "2", "--pipeline-layout", "3,3"],
     "pipeline_layout (--pipeline-layout) holds 6 layers"),
    (["estimate", "--model", "llama3-8b", "--pp", "2", "--virtual-stages", "2"],
     "microbatches=1 (--global-batch / (--micro-batch x dp)): the interleaved schedule needs a multiple of pp=2"),
    # one chunk per rank ran 1F1B's order with more micro-batches held, unsaid
    (["estimate", "--model", "llama3-8b", "--pp", "2", "--pp-schedule", "interleaved", "--global-batch", "8"],
     "pp_schedule='interleaved' (--pp-schedule) with virtual_stages=1: interleaving needs 2 or more"),
    (["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "interleaved"], "needs 2 or more model chunks"),
    # DistMM took them and ignored them, unsaid: --chart wrote nothing, --tp changed no tower
    (["plan", "--model", "lit-b16-text-g", "--gpus", "16", "--tp", "2", "--chart", "d.png"],
     "--model lit-b16-text-g is a dual encoder, planned by DistMM, which takes none of --chart --tp (it takes"),
    (["plan", "--model", "lit-b16-text-g", "--gpus", "1", "--global-batch", "64"],
     "each of its 2 towers needs GPUs of its own, no more data-parallel replicas than sequences"),
    # matplotlib wrote NAME.png past the check of NAME (an existing NAME.png was replaced unasked)
    (["schedule", "--pp", "2", "--microbatches", "4", "-o", "chartnoext"], "-o chartnoext: no suffix names the "),
    # refused after the search (or the measured step) by the write, as an OS error
    (["schedule", "--pp", "2", "--microbatches", "4", "-o", "nodir/x.png"], "-o nodir/x.png: no such folder 'nodir'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_plugin_that_cannot_be_imported_is_one_line_and_exit_2():
    """In a fresh process: the registries load their plugins once per process, when first read."""
    import os
    import subprocess

    env = {**os.environ, "ORANGETRON_PLUGINS": "no_such_plugin_module"}
    done = subprocess.run([sys.executable, "-m", "orangetron", "presets"], env=env, capture_output=True, text=True,
                          timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and "cannot import plugin 'no_such_plugin_module'" in err and "PYTHONPATH" in err
    assert len(err.splitlines()) == 1


def test_a_dual_encoder_given_to_train_names_the_command_that_prices_it(capsys):
    assert run(["train", "--model", "clip-vit-bigg14", "--steps", "1"]) == 2
    hint = capsys.readouterr().err.split("`")[1]
    assert hint == "orangetron plan --model clip-vit-bigg14"
    assert run([*hint.split()[1:], "--gpus", "8"]) == 0  # the command it names runs


def test_estimate_fits_on_what_a_layout_needs_not_on_what_it_reserves_with_room(capsys):
    """Llama 3 8B, ZeRO-3 on 8 H100 at 8192 tokens: 84.9 GiB reserved with room to spare (19% fragmentation)
    but 75.5 GiB needed (2%) on a 79.65 GiB GPU: it fits, no warning, and the text shows both figures."""
    args = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--zero-stage", "3", "--seq", "8192",
            "--global-batch", "64"]
    assert run([*args, "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out.strip().splitlines()[-1])
    memory, capacity = data["memory_bytes"], data["memory_capacity_bytes"]
    assert memory["needed"] <= capacity < memory["total"] and data["fits"] and "warning" not in captured.err
    assert run(args) == 0
    text = capsys.readouterr().out
    assert f"  needed       {memory['needed'] / 2**30:10.2f}" in text and "does NOT fit" not in text


def test_plan_searches_gradient_buckets_unless_told_not_to(capsys):
    """Llama 3 8B on 16 H100: the fastest row reduces in 40M-element buckets, shown +b and carried in the JSON;
    `--grad-bucket-numel 0` searches none, and a negative size is refused by name."""
    args = ["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch", "64", "--top", "3",
            "--tp", "1", "--pp", "1", "--cp", "1"]
    assert run([*args, "--json"]) == 0
    ranked = last_json(capsys)["ranked"]
    assert ranked[0]["job"]["bucket_numel"] == 40_000_000
    assert run(args) == 0
    assert "+b " in capsys.readouterr().out.splitlines()[2]
    assert run([*args, "--json", "--grad-bucket-numel", "0"]) == 0
    assert {row["job"]["bucket_numel"] for row in last_json(capsys)["ranked"]} == {0}
    assert run([*args, "--grad-bucket-numel", "-1"]) == 2
    assert "--grad-bucket-numel -1" in capsys.readouterr().err


def test_estimate_text_names_every_option_it_priced(capsys):
    """The line under the header names the sharding, dtypes, kernel, recompute, SP, cp mode, schedule and its
    layout, the dispatcher of a MoE model and each framework path asked for; a default leaves its word out."""
    assert run(["estimate", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4", "--dp", "2",
                "--virtual-stages", "2", "--sequence-parallel", "--distributed-optimizer", "--recompute", "full",
                "--global-batch", "64", "--eager-fp32-loss", "--tp-sum-with-reduction", "--reduce-dtype", "float32",
                "--optimizer-state-dtype", "bfloat16", "--no-overlap-grad-reduce"]) == 0
    options = capsys.readouterr().out.splitlines()[1]
    assert options == ("options: distopt, bfloat16, attention flash, recompute full, reduce in float32, adam moments "
                       "in bfloat16, sequence parallel, interleaved v=2, --no-overlap-grad-reduce, "
                       "--tp-sum-with-reduction, --eager-fp32-loss")
    assert run(["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--cp", "2", "--dp", "8", "--ep", "8",
                "--zero-stage", "3", "--fp8", "--fp8-recipe", "blockwise", "--cp-mode", "allgather",
                "--no-overlap-ep", "--no-overlap-shared-experts"]) == 0
    options = capsys.readouterr().out.splitlines()[1]
    assert options == ("options: zero3, bfloat16 with fp8 (blockwise), attention flash, recompute none, cp allgather, "
                       "dispatcher ragged, --no-overlap-ep, --no-overlap-shared-experts")
    assert run(["estimate", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "8", "--fp8", "--fp8-recipe",
                "blockwise", "--fp8-cached-activations"]) == 0
    options = capsys.readouterr().out.splitlines()[1]
    assert options.startswith("options: ddp, bfloat16 with fp8 (blockwise, cached activations), attention flash")


def test_estimate_reports_a_configuration_that_does_not_fit(capsys):
    """405B on 8 GPUs needs about 6 TiB of model states: every number is still printed, with "fits": false, a
    warning on standard error (its first line says why, the next what would fit) and exit status 0."""
    assert run(["estimate", "--model", "llama3-405b", "--gpus", "8", "--tp", "8", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out.strip().splitlines()[-1])
    assert data["fits"] is False
    assert data["memory_bytes"]["needed"] > data["memory_capacity_bytes"]
    assert data["step_time_s"] > 0 and data["mfu"] > 0 and data["comm_bytes"]
    warning = captured.err.strip().splitlines()
    assert "warning" in warning[0] and "does not fit" in warning[0] and "add GPUs" in warning[-1]
    assert run(["estimate", "--model", "llama3-405b", "--gpus", "8", "--tp", "8"]) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_estimate_of_a_fitting_configuration_warns_nothing(capsys):
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--sequence-parallel",
                "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["fits"] is True and captured.err == ""


def test_estimate_gives_tokens_per_gpu_and_the_causal_mfu_beside_the_full_attention_one(capsys):
    """At 65536 tokens the full s x s attention count (MFU) and its causal half differ by far; both are printed
    and in the JSON, with the throughput per GPU the published runs state (the JSON's `tokens_per_s` is the
    cluster's)."""
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--cp", "8", "--seq", "65536", "--global-batch", "8",
            "--zero-stage", "3", "--recompute", "full"]
    assert run([*argv, "--json"]) == 0
    est = last_json(capsys)
    assert est["tokens_per_s"] == pytest.approx(8 * 65536 / est["step_time_s"], rel=1e-12)
    assert est["tokens_per_s_per_gpu"] == pytest.approx(est["tokens_per_s"] / 8, rel=1e-12)
    assert 0 < est["mfu_causal"] < 0.75 * est["mfu"]  # attention is most of the FLOPs at this length
    assert run(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (f"{est['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {est['tflops_per_gpu']:.1f} TFLOP/s per "
                    f"GPU, MFU {100 * est['mfu']:.1f}% (attention counted whole; causal half "
                    f"{100 * est['mfu_causal']:.1f}%; HFU {100 * est['hfu']:.1f}%)")
    assert run(["estimate", "--model", "tiny", "--seq", "16", "--gpu", "rtx3090", "--json"]) == 0
    small = last_json(capsys)["tflops_per_gpu"]
    assert run(["estimate", "--model", "tiny", "--seq", "16", "--gpu", "rtx3090"]) == 0  # was "0.1 TFLOP/s"
    assert f"tokens/s per GPU, {small * 1e3:.1f} GFLOP/s per GPU, MFU" in capsys.readouterr().out and small < 0.1


def test_estimate_notes_each_option_its_layout_does_not_use_and_none_it_does(capsys):
    idle = ["--sequence-parallel", "--virtual-stages", "2", "--cp-mode", "usp", "--ulysses-degree", "2",
            "--dispatcher", "deepep", "--zero3-keep-params"]
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "8", "--dp", "8", *idle]) == 0
    notes = [line.split("note: ", 1)[1] for line in capsys.readouterr().err.splitlines() if "note: " in line]
    assert notes == ["--sequence-parallel has no effect here: needs --tp > 1",
                     "--cp-mode has no effect here: needs --cp > 1",
                     "--ulysses-degree has no effect here: needs --cp > 1",
                     "--virtual-stages has no effect here: needs --pp > 1",
                     "--dispatcher has no effect here: needs --ep > 1",
                     "--zero3-keep-params has no effect here: needs --zero-stage 3"]
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "1", "--zero-stage", "1", "--grad-bucket-numel",
                "1000", "--reduce-dtype", "float32", "--recompute", "full", "--recompute-layers", "40"]) == 0
    notes = [line.split("note: ", 1)[1] for line in capsys.readouterr().err.splitlines() if "note: " in line]
    # buckets are not idle at dp 1: each frees its gradients into the flat buffer early (param_grads)
    assert notes == ["--zero-stage has no effect here: needs --dp or --cp > 1: nothing to shard",
                     "--reduce-dtype has no effect here: needs --dp or --cp > 1: no gradient reduction",
                     "--recompute-layers has no effect here: is not below the 32 layers of the longest pipeline "
                     "chunk: every layer replays, as with 0"]
    used = ["--tp", "2", "--sequence-parallel", "--cp", "2", "--cp-mode", "allgather", "--pp", "2",
            "--virtual-stages", "2", "--zero-stage", "3", "--zero3-keep-params", "--recompute", "full",
            "--recompute-layers", "3", "--grad-bucket-numel", "0", "--reduce-dtype", "float32"]
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch", "16",
                *used]) == 0
    assert "no effect" not in capsys.readouterr().err
    # ZeRO-3 on one replica still gathers and frees unit by unit: priced apart from DDP, so not idle
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--zero-stage", "3"]) == 0
    assert "no effect" not in capsys.readouterr().err
    # a capacity factor only a padding dispatcher reads (train warns of it alike)
    assert run(["estimate", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--capacity-factor", "2"]) == 0
    assert "--capacity-factor has no effect here: needs --dispatcher capacity with --ep" in capsys.readouterr().err
    assert run(["estimate", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--dispatcher", "capacity",
                "--capacity-factor", "2"]) == 0
    assert "no effect" not in capsys.readouterr().err


def test_the_fp8_row_shows_where_the_json_has_it(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--sequence-parallel"]
    for flags in ([], ["--fp8"]):
        assert run([*argv, *flags, "--json"]) == 0
        has = "fp8" in last_json(capsys)["memory_bytes"]
        assert run([*argv, *flags]) == 0
        assert has == bool(flags) == any(line.split()[:1] == ["fp8"] for line in capsys.readouterr().out.splitlines())


def test_plan_ranked_table_and_json(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "16", "--seq", "8192", "--global-batch",
            "64", "--top", "5"]
    assert run(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("llama3-8b on 16 x h100, seq 8192, global batch 64 sequences")
    assert out[1].split()[:4] == ["#", "tp", "cp", "pp"] and len(out) == 7
    assert run([*argv, "--json"]) == 0
    data = last_json(capsys)
    times = [e["step_time_s"] for e in data["ranked"]]
    assert times == sorted(times) and len(times) == 5
    assert all(e["fits"] for e in data["ranked"])
    assert data["considered"] >= data["evaluated"] >= 5


def test_plan_restricted_degrees(capsys):
    assert run(["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "32",
                "--tp", "2,4", "--pp", "1", "--json"]) == 0
    ranked = last_json(capsys)["ranked"]
    assert ranked and all(e["layout"]["tp"] in (2, 4) and e["layout"]["pp"] == 1 for e in ranked)


def test_plan_says_which_rule_every_layout_broke_and_blames_memory_only_when_it_is_why(capsys):
    """`--ep 2` on a dense model: every configuration breaks the expert rule, which is named with its flag; a
    model too large for its GPUs is told it does not fit, and a restriction no degree meets is named."""
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "no configuration of 8 GPUs searched can run llama3-8b; the first refused: ep=2 (--ep): the model has " \
        "no experts (n_experts=0); use ep=1" in err and "fits" not in err
    assert run(["plan", "--model", "llama3-405b", "--gpus", "8", "--seq", "8192"]) == 2
    assert "no layout of 8 x h100 fits llama3-405b with seq 8192" in capsys.readouterr().err
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "3"]) == 2
    assert "no layout of 8 GPUs has --tp 3: tp*cp*pp must divide the GPU count" in capsys.readouterr().err
    # An ep the experts cannot split: the experts are named, not the GPU count
    assert run(["plan", "--model", "tiny-moe", "--gpus", "4", "--seq", "16", "--global-batch", "4", "--ep", "3"]) == 2
    assert "no layout of 4 GPUs has --ep 3: ep=3: n_experts=4 is not divisible by ep" in capsys.readouterr().err
    # Degrees that exist but split no batch: the batch is named, not the divisibility of degrees that hold.
    assert run(["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "32", "--tp", "1", "--cp", "1",
                "--pp", "1"]) == 2
    assert "no layout of 64 GPUs with --tp 1 --cp 1 --pp 1 splits the global batch of 32 sequences over its dp " \
        "(64): each data-parallel rank takes whole micro-batches; give --global-batch a multiple of 64" \
        in capsys.readouterr().err


def test_a_sequence_past_a_stated_length_is_noted_and_the_header_counts_the_parameters(capsys):
    """A preset that states its length (llama3-8b's config.json, 8192) notes a longer --seq, which train refuses;
    one that states none (gpt3-175b keeps the schema's default) does not. The header counts the parameters."""
    assert run(["estimate", "--model", "llama3-8b", "--seq", "16384", "--global-batch", "8"]) == 0
    captured = capsys.readouterr()
    assert "note: --seq 16384 is longer than llama3-8b's max_seq_len 8192" in captured.err
    assert captured.out.startswith("llama3-8b (8.0B parameters) on 1 x h100")
    assert run(["estimate", "--model", "mixtral-8x7b", "--seq", "4096", "--global-batch", "8"]) == 0
    assert capsys.readouterr().out.startswith("mixtral-8x7b (46.7B parameters, 12.9B active) on 1 x h100")
    assert run(["estimate", "--model", "gpt3-175b", "--seq", "8192", "--gpus", "64", "--tp", "8", "--pp", "8",
                "--global-batch", "64"]) == 0
    assert "note" not in capsys.readouterr().err


def test_the_table_names_each_rows_schedule_and_emit_config_looks_below_the_rows_shown(tmp_path, capsys):
    """zb-h1 (planner only) ranks above 1F1B: the table tells the rows apart by their schedule, and with --top 1
    `--emit-config` still finds the fastest row the trainer runs, further down, and says it is not shown."""
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--seq", "64", "--global-batch", "16", "--pp", "2",
            "--pp-schedule", "zb-h1", "--pp-schedule", "1f1b"]
    assert run([*argv, "--top", "5"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert rows[0].split()[5] == "schedule" and [r.split()[5] for r in rows[1:]] == ["zb-h1"] * 4 + ["1f1b"]
    from orangetron.plan.chart import _label
    from orangetron.plan.search import search
    from orangetron.spec.hardware import make_cluster
    from orangetron.spec.model import load_model

    best = search(load_model("tiny"), make_cluster("h100", 4), 64, 16, top=1).ranked[0]
    plain = replace(best.job, zero_stage=0, distributed_optimizer=False, zero3_reduce_every_microbatch=False,
                    grad_bucket_numel=0)
    assert sharding_label(replace(plain, grad_bucket_numel=8)) == "ddp+b"  # the chart's label dropped the +b
    assert sharding_label(replace(plain, zero_stage=3, zero3_reduce_every_microbatch=True)) == "zero3-mb"
    assert _label(replace(best, job=replace(plain, grad_bucket_numel=8))).endswith("\nddp+b")
    path = tmp_path / "plan.toml"
    assert run([*argv, "--top", "1", "--emit-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "configuration #5 (below the 1 shown); the trainer does not run #1-#4: pp_schedule='zb-h1'" in err
    assert 'pp_schedule = "1f1b"' in path.read_text()


def test_plan_dual_encoder_runs_distmm(capsys):
    assert run(["plan", "--model", "lit-b16-text-g", "--gpus", "8", "--global-batch", "512", "--json"]) == 0
    data = last_json(capsys)
    assert {t["name"] for t in data["towers"]} == {"image", "text"} and data["predicted_gain"] > 0


def test_chart_without_matplotlib_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--chart", str(tmp_path / "c.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_chart_is_written_and_named(tmp_path, capsys):
    chart = tmp_path / "c.png"
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "3", "--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart written to {chart}" in capsys.readouterr().err
    # A file already there is refused before the search, as every command that writes refuses one ...
    chart.write_text("mine")
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "3", "--chart", str(chart)]) == 2
    err = capsys.readouterr().err
    assert "exists; choose another name, or add --overwrite" in err and "priced" not in err
    assert chart.read_text() == "mine"
    # ... and moved aside, saying where, with --overwrite.
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "3", "--chart", str(chart), "--overwrite"]) == 0
    aside = tmp_path / "c.png.previous-1"
    assert f"chart written to {chart} (the former file moved to {aside})" in capsys.readouterr().err
    assert aside.read_text() == "mine" and chart.read_bytes()[:4] == b"\x89PNG"
    # A format no chart is written in is refused before the search, not after it.
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--chart", str(tmp_path / "c.txt")]) == 2
    err = capsys.readouterr().err
    assert "no chart is written as .txt; name a .png" in err and "priced" not in err


def test_plan_without_gpus_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        run(["plan", "--model", "llama3-8b"])
    assert exit.value.code == 2 and "--gpus" in capsys.readouterr().err
    assert "[--gpus GPUS]" not in run_help(["plan", "--help"], capsys)  # shown as required


def run_help(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        run(argv)
    return capsys.readouterr().out


def test_presets_lists_every_preset_file(capsys):
    from importlib import resources

    from orangetron.model.config import MODEL_PRESETS

    root = resources.files("orangetron.spec").joinpath("presets")
    files = {kind: sorted(f.name[:-5] for f in root.joinpath(kind).iterdir() if f.name.endswith(".toml"))
             for kind in ("models", "gpus")}
    assert run(["presets", "--json"]) == 0
    data = last_json(capsys)
    assert [m["name"] for m in data["plan_models"]] == files["models"]
    assert [g["name"] for g in data["gpus"]] == files["gpus"]
    assert [m["name"] for m in data["train_models"]] == list(MODEL_PRESETS)
    h100 = next(g for g in data["gpus"] if g["name"] == "h100")
    assert h100["bf16_tflops"] == 989.4  # the H100 SXM datasheet's dense BF16 peak
    assert run(["presets"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in files["models"] + files["gpus"])
    # Counts below a billion in millions (small-moe: 4,473,344 parameters), above in billions.
    small = next(m for m in data["plan_models"] if m["name"] == "small-moe")
    assert f"{small['params'] / 1e6:.1f}M params" in text and "671.0B params" in text


def _with_and_without(capsys, argv: list[str], flag: str) -> tuple[dict, dict]:
    """`estimate --json` of `argv` without `flag`, then with it."""
    jsons = []
    for extra in ([], [flag]):
        assert run([*argv, "--json", *extra]) == 0
        jsons.append(last_json(capsys))
    return jsons[0], jsons[1]


def test_estimate_fp8_prices_fp8_gemms_and_weight_copies(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--sequence-parallel", "--seq", "8192"]
    bf16, fp8 = _with_and_without(capsys, argv, "--fp8")
    assert fp8["job"]["fp8"] is True and "fp8" not in bf16["memory_bytes"]
    assert fp8["step_time_s"] < bf16["step_time_s"]
    assert fp8["memory_bytes"]["fp8"] > 0
    assert run([*argv, "--fp8", "--gpu", "a100-80gb"]) == 2
    assert "no FP8 tensor cores" in capsys.readouterr().err


def test_fp8_cached_activations_flag_round_trips_and_needs_blockwise(capsys):
    argv = ["estimate", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "8", "--fp8", "--fp8-recipe", "blockwise"]
    plain, cached = _with_and_without(capsys, argv, "--fp8-cached-activations")
    assert plain["job"]["fp8_cached_activations"] is False and cached["job"]["fp8_cached_activations"] is True
    assert cached["memory_bytes"]["activations"] < plain["memory_bytes"]["activations"]
    assert run(["estimate", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "8", "--fp8",
                "--fp8-cached-activations"]) == 2
    assert "needs fp8=True with fp8_recipe='blockwise'" in capsys.readouterr().err


def test_fp8_recipe_flag_in_estimate_and_plan(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--sequence-parallel", "--seq", "8192",
            "--json", "--fp8"]
    assert run(argv) == 0
    delayed = last_json(capsys)
    assert run([*argv, "--fp8-recipe", "blockwise"]) == 0
    blockwise = last_json(capsys)
    assert delayed["job"]["fp8_recipe"] == "delayed" and blockwise["job"]["fp8_recipe"] == "blockwise"
    # Delayed scaling keeps 32 layers x 4 GEMMs x 3 operands x (2 + 1024) fp32 values; blockwise one fp32 per
    # 128 x 128 block of both weight copies.
    copies = delayed["memory_bytes"]["fp8"] - 32 * 4 * 3 * 1026 * 4
    assert blockwise["memory_bytes"]["fp8"] == copies + 2 * 4 * -(-(copies // 2) // (128 * 128))
    assert blockwise["memory_bytes"]["activations"] > delayed["memory_bytes"]["activations"]
    assert run([*argv, "--fp8-recipe", "current"]) == 0
    current = last_json(capsys)
    # Current scaling keeps one amax per operand where delayed scaling keeps a history of 1024.
    assert current["job"]["fp8_recipe"] == "current"
    assert delayed["memory_bytes"]["fp8"] - current["memory_bytes"]["fp8"] == 32 * 4 * 3 * 1023 * 4
    # A recipe without --fp8 would price nothing, the default recipe included.
    for recipe in ("blockwise", "delayed"):
        assert run(argv[:-1] + ["--fp8-recipe", recipe]) == 2
        assert f"fp8_recipe='{recipe}' (--fp8-recipe) needs fp8=True" in capsys.readouterr().err
    assert run(["plan", "--model", "llama3-8b", "--gpus", "8", "--fp8-recipe", "delayed"]) == 2
    assert "fp8_recipe='delayed' (--fp8-recipe) needs fp8=True" in capsys.readouterr().err
    assert run(["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch", "64", "--fp8",
                "--fp8-recipe", "blockwise", "--top", "2", "--json"]) == 0
    assert all(e["job"]["fp8_recipe"] == "blockwise" for e in last_json(capsys)["ranked"])


def test_estimate_expert_tensor_parallel_flag(capsys):
    argv = ["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "8", "--sequence-parallel",
            "--seq", "4096", "--json"]
    assert run([*argv, "--etp", "2"]) == 0
    assert last_json(capsys)["layout"]["etp"] == 2
    assert run([*argv, "--etp", "4"]) == 2
    assert "etp=4" in capsys.readouterr().err


def test_plan_fp8_ranks_configurations_with_their_fp8_memory(capsys):
    assert run(["plan", "--model", "llama3-8b", "--gpus", "16", "--seq", "8192", "--global-batch", "64", "--fp8",
                "--top", "3", "--json"]) == 0
    ranked = last_json(capsys)["ranked"]
    assert ranked and all(e["job"]["fp8"] and e["memory_bytes"]["fp8"] > 0 and e["fits"] for e in ranked)


def test_estimate_flash2_keeps_memory_and_slows_attention(capsys):
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--tp", "2", "--cp", "2",
            "--seq", "32768", "--global-batch", "2", "--sequence-parallel", "--json"]
    assert run(args) == 0
    best = last_json(capsys)
    assert run([*args, "--attention-kernel", "flash2"]) == 0
    fa2 = last_json(capsys)
    assert fa2["memory_bytes"] == best["memory_bytes"]
    assert fa2["step_time_s"] > best["step_time_s"]


def test_estimate_etp_adds_expert_tp_traffic(capsys):
    args = ["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--ep", "8", "--seq", "4096",
            "--global-batch", "16", "--sequence-parallel", "--json"]
    assert run(args) == 0
    plain = last_json(capsys)["comm"]
    assert run([*args, "--etp", "2"]) == 0
    split = last_json(capsys)["comm"]
    assert "all_gather/etp" not in plain and split["all_gather/etp"]["calls"] > 0
    assert split["all_gather/tp"] == plain["all_gather/tp"]
    assert split["all_to_all/ep"] == plain["all_to_all/ep"]
    # Split over tp, the routed experts are no longer whole on both tp ranks: their gradients leave the tp sum,
    # 32 layers x one local expert (3 x 4096 x 14336) x 2 bytes.
    assert plain["all_reduce/tp"]["payload"] - split["all_reduce/tp"]["payload"] == 32 * 3 * 4096 * 14336 * 2


def test_estimate_folds_experts_with_edp(capsys):
    args = ["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "4", "--ep", "8", "--seq", "4096",
            "--global-batch", "16", "--sequence-parallel", "--json"]
    assert run(args) == 2  # unfolded, ep = 8 must divide dp x cp = 4
    assert "a folded expert mesh, planner only, lifts this" in capsys.readouterr().err
    assert run([*args, "--edp", "2"]) == 0
    layout = last_json(capsys)["layout"]
    assert layout["expert_fold"] is True and (layout["ep"], layout["etp"], layout["edp"]) == (8, 1, 2)
    assert run([*args, "--edp", "4"]) == 2
    assert "etp x ep x edp = 32 must equal tp*cp*dp = 16" in capsys.readouterr().err
    assert run([*args[:-1], "--edp", "2"]) == 0
    assert "(folded)" in capsys.readouterr().out


def test_plan_replays_only_the_layers_memory_needs(capsys):
    """Llama 3 8B at 49152 tokens on 4 H100: replaying 13 of 32 layers (cp 4) beats replaying all of them, which
    `--no-partial-recompute` is left with; the table shows full/13."""
    args = ["plan", "--model", "llama3-8b", "--gpus", "4", "--seq", "49152", "--global-batch", "4", "--top", "2"]
    assert run([*args, "--json"]) == 0
    partial = last_json(capsys)["ranked"][0]
    assert run([*args, "--json", "--no-partial-recompute"]) == 0
    whole = last_json(capsys)["ranked"][0]
    assert partial["job"]["recompute"] == "full" and partial["job"]["recompute_layers"] == 13
    assert whole["job"]["recompute_layers"] == 0
    assert partial["step_time_s"] < whole["step_time_s"]
    assert run(args) == 0
    assert " full/13 " in capsys.readouterr().out


def test_estimate_names_the_stage_its_memory_is_of(capsys):
    """With pipeline stages the memory figures are the busiest stage's; here the first, which holds the most
    micro-batches in flight and the embedding."""
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--seq", "2048"]
    assert run([*argv, "--pp", "2", "--global-batch", "16"]) == 0
    assert "memory per GPU (GiB), pipeline stage 0 of 2, the busiest:" in capsys.readouterr().out
    assert run(argv) == 0
    assert "memory per GPU (GiB):" in capsys.readouterr().out


def test_a_tiny_models_report_reads_in_units_where_its_figures_are_not_zero(capsys):
    """Every figure of a tiny model printed as 0.00 GiB, 0.000 GiB sent and 0.000 s: each table now takes the
    largest unit in which its largest figure reads 0.1 or more; the numbers are the JSON's, in that unit."""
    argv = ["estimate", "--model", "tiny", "--gpus", "2", "--tp", "2", "--seq", "64"]
    assert run([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert run(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "memory per GPU (MiB):" in lines and "communication per step (KiB sent by one rank of stage 0):" in lines
    value = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("  ")}
    assert value["params"] == pytest.approx(figures["memory_bytes"]["params"] / 2**20, abs=0.005) and value["params"]
    assert value["overhead"] == pytest.approx(figures["memory_bytes"]["overhead"] / 2**20, abs=0.005)
    assert value["all_reduce/tp"] == pytest.approx(figures["comm"]["all_reduce/tp"]["sent"] / 2**10, abs=5e-4)
    step = next(line for line in lines if line.startswith("step time "))
    assert step.startswith(f"step time {figures['step_time_s'] * 1e6:.3f} us: ")
    assert run(["plan", "--model", "tiny", "--gpus", "2", "--seq", "64"]) == 0
    assert " step us " in capsys.readouterr().out
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "8", "--seq", "2048", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU (GiB):" in out and "(GiB sent by one rank" in out and " ms: compute " in out  # 57 ms


def test_plan_ranks_layouts_for_a_framework_that_overlaps_no_expert_transfer(capsys):
    """`plan` takes the two overlap switches `estimate` takes, so it can rank layouts for Megatron-Core's
    defaults: every ranked job carries them (and without them, neither)."""
    args = ["--model", "small-moe", "--gpus", "8", "--no-overlap-ep", "--no-overlap-shared-experts", "--json"]
    assert run(["plan", *args, "--top", "5"]) == 0
    ranked = last_json(capsys)["ranked"]
    assert len(ranked) == 5
    assert {(r["job"]["overlap_ep"], r["job"]["overlap_shared_experts"]) for r in ranked} == {(False, False)}
    assert run(["plan", "--model", "small-moe", "--gpus", "8", "--json", "--top", "5"]) == 0
    assert {(r["job"]["overlap_ep"], r["job"]["overlap_shared_experts"])
            for r in last_json(capsys)["ranked"]} == {(True, True)}
    assert run(["plan", *args[:-1], "--top", "1"]) == 0  # the text says what it ranked for
    assert capsys.readouterr().out.splitlines()[0] == (
        "small-moe on 8 x h100, seq 4096, global batch 8 sequences, bfloat16, --no-overlap-ep, "
        "--no-overlap-shared-experts: the fastest layout that fits (sequence parallel where tp > 1)")


def test_emit_config_names_the_plan_flag_to_drop(tmp_path, capsys):
    assert run(["plan", "--model", "tiny", "--gpus", "2", "--seq", "256", "--fp8", "--emit-config",
                str(tmp_path / "f.toml")]) == 2
    assert "fp8=True: the trainer runs False only (drop --fp8))" in capsys.readouterr().err
    assert run(["plan", "--model", "tiny", "--gpus", "2", "--seq", "256", "--attention-kernel", "eager",
                "--emit-config", str(tmp_path / "f.toml")]) == 2
    assert "attention_kernel='eager': the trainer runs 'flash' only (leave --attention-kernel out))" in \
        capsys.readouterr().err
