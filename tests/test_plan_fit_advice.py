"""`estimate` explains a configuration that does not fit: its largest categories and the changes that fit."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from orangetron import cli

BASE = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--seq", "8192", "--global-batch", "16"]


def _estimate(capsys, *flags: str) -> tuple[dict, str]:
    assert cli.main([*BASE, *flags, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_a_configuration_that_does_not_fit_names_changes_that_do(capsys) -> None:
    est, err = _estimate(capsys, "--dp", "8")
    assert not est["fits"] and "llama3-8b does not fit" in err
    largest = err.split("largest: ", 1)[1].split(" GiB", 1)[0]
    gib = {k: v / 2**30 for k, v in est["memory_bytes"].items()}
    tensors = est["memory_bytes"]["total"] - est["memory_bytes"]["overhead"]
    gib["overhead"] = (est["memory_bytes"]["needed"] - tensors) / 2**30  # as the fit check counts it
    top = sorted(("params", "grads", "main_params", "optimizer", "activations", "buffers", "overhead"),
                 key=lambda k: -gib[k])[:3]
    assert largest == ", ".join(f"{k} {gib[k]:.1f}" for k in top)
    steps = _each_suggestion_reproduced(capsys, [*BASE, "--dp", "8"], est)
    assert len(steps) == 3
    known, _ = _estimate(capsys, "--dp", "8", "--zero-stage", "3", "--recompute", "full")  # a fit by hand
    assert known["fits"] and steps[0] <= known["step_time_s"]  # nothing faster was passed over for it


def _each_suggestion_reproduced(capsys, command: list[str], est: dict) -> list[float]:
    """Each suggestion, its flags added to `command` as printed, fits and costs what it says at the global batch
    of `est` (`command`'s own estimate); its step times, in the order given."""
    assert cli.main([*command]) == 0
    err = capsys.readouterr().err
    suggested = [line.strip() for line in err.splitlines() if line.startswith("  --")]
    assert suggested and f"the same global batch ({_batch(est)} sequences)" in err
    steps, figures_seen, ties = [], set(), []
    for line in suggested:
        flags, figures = line.split(": ", 1)
        assert cli.main([*command, *shlex.split(flags), "--json"]) == 0, line
        fixed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert fixed["fits"] and _batch(fixed) == _batch(est), line
        assert figures.startswith(f"needs {fixed['memory_bytes']['needed'] / 2**30:.1f} GiB, step "
                                  f"{fixed['step_time_s']:.3f} s"), line
        assert figures not in figures_seen, line  # no suggestion repeats another's figures
        figures_seen.add(figures)
        steps.append(fixed["step_time_s"])
        ties.append((fixed["step_time_s"], flags.count("--"), fixed["memory_bytes"]["needed"]))
    assert steps == sorted(steps)  # fastest first
    assert ties == sorted(ties)  # among equal times, fewer flags, then less memory
    return steps


def _batch(est: dict) -> int:
    """Sequences per step of an `estimate --json` object."""
    return est["job"]["num_microbatches"] * est["job"]["micro_batch"] * est["layout"]["dp"]


LLAMA70 = ["estimate", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--tp", "8", "--pp", "2"]
LONG_8B = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "4", "--dp", "4", "--seq", "65536"]


def test_suggestions_keep_the_batch_a_default_gave_and_a_dp_that_was_given(capsys) -> None:
    """Llama 3 8B at 65536 tokens on 4 GPUs at dp 4 without --global-batch (one micro-batch per replica: 4
    sequences): a larger tp would shrink that default batch, and so look faster, unless the suggestion names it,
    and it names the dp it leaves (the command's --dp 4 would contradict it). Where the batch was given, only the
    dp is named."""
    assert cli.main([*LONG_8B, "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not est["fits"] and _batch(est) == 4
    _each_suggestion_reproduced(capsys, LONG_8B, est)
    assert cli.main(LONG_8B) == 0
    suggested = [line.split(":")[0].strip() for line in capsys.readouterr().err.splitlines() if line.startswith("  --")]
    assert "--recompute full --recompute-layers 20 --tp 4 --sequence-parallel --dp 1 --global-batch 4" in suggested
    given = [*LLAMA70, "--dp", "4", "--seq", "8192", "--global-batch", "64", "--tp", "4", "--gpus", "32"]  # pp 2
    assert cli.main([*given, "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not est["fits"]
    _each_suggestion_reproduced(capsys, given, est)
    assert cli.main(given) == 0
    suggested = [line.split(":")[0].strip() for line in capsys.readouterr().err.splitlines() if line.startswith("  --")]
    assert any("--pp 4" in s and s.endswith("--dp 1") for s in suggested)  # tp 8 x pp 4 leaves dp 1, named
    assert not any("--global-batch" in s for s in suggested)


def test_sequence_parallelism_is_offered_and_comes_with_every_larger_tp(capsys) -> None:
    """Llama 3 70B at tp 8 without sequence parallelism: turning it on splits the activations tp ways for the
    same bytes on the wire, so a fit with it is faster than every fit without it; a larger tp is offered with it
    too, as `plan` ranks tp > 1."""
    command = [*LLAMA70, "--dp", "4", "--seq", "8192", "--global-batch", "64"]
    assert cli.main([*command, "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not est["fits"]
    steps = _each_suggestion_reproduced(capsys, command, est)
    assert cli.main(command) == 0
    suggested = [line.split(":")[0].strip() for line in capsys.readouterr().err.splitlines() if line.startswith("  --")]
    assert all("--sequence-parallel" in s for s in suggested)
    assert cli.main([*command, "--zero-stage", "2", "--recompute-modules", "mlp", "--grad-bucket-numel", "40000000",
                     "--json"]) == 0  # the best fit without it, as offered before sequence parallelism was
    without = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert without["fits"] and steps[0] < without["step_time_s"]
    small = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--dp", "8", "--seq", "8192",
             "--global-batch", "64"]
    assert cli.main([*small, "--json"]) == 0
    _each_suggestion_reproduced(capsys, small, json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    # every change that fits, beyond the three printed (ZeRO-3 stands first there)
    from orangetron.plan.estimate import estimate
    from orangetron.plan.fit_advice import fixes
    from orangetron.spec.hardware import make_cluster
    from orangetron.spec.model import load_model
    from orangetron.spec.options import Degrees, Job

    est = estimate(load_model("llama3-8b"), Degrees(dp=8), Job(seq_len=8192, global_batch=64), make_cluster("h100", 8))
    offered = [fix.change for fix in fixes(est)]
    assert [s for s in offered if "--tp" in s] and all("--sequence-parallel" in s for s in offered if "--tp" in s)


def test_the_distributed_optimizer_is_not_offered_zero_1_and_buckets_are_offered(capsys) -> None:
    """ZeRO-1 beside the distributed optimizer shards the same states: it would repeat a suggestion without it.
    Gradient buckets reduced during backward hold a bucket's wire buffer, not every gradient's: the cheapest
    fit of Llama 3 70B at tp 4 under the distributed optimizer."""
    command = ["estimate", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--tp", "4",
               "--distributed-optimizer", "--global-batch", "64"]
    assert cli.main([*command, "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _each_suggestion_reproduced(capsys, command, est)
    assert cli.main(command) == 0
    suggested = [line.split(":")[0].strip() for line in capsys.readouterr().err.splitlines() if line.startswith("  --")]
    assert not [s for s in suggested if "--zero-stage 1" in s]
    assert "--grad-bucket-numel 40000000" in suggested[0]


def test_no_zero_stage_is_suggested_where_the_change_leaves_no_data_parallel_ranks(capsys) -> None:
    """Llama 3 8B at 65536 tokens on 4 GPUs: tp 4 leaves dp 1, where a ZeRO stage shards nothing, so no suggestion
    pairs them (it would shard over one rank); ZeRO stays suggested beside a tp 2. The overhead the
    layout needs (fixed, and 2% of 350 GiB of activations and buffers) is not among its largest categories, though
    the 19% it would reserve with room to spare (68 GiB) would be."""
    assert cli.main(["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "4", "--dp", "4", "--seq",
                     "65536", "--global-batch", "4"]) == 0
    err = capsys.readouterr().err
    assert "largest: activations 304.6, optimizer 59.8, buffers 44.9 GiB" in err
    suggested = [line.split(":")[0].strip() for line in err.splitlines() if line.startswith("  --")]
    assert "--recompute full --recompute-layers 20 --tp 4 --sequence-parallel --dp 1" in suggested
    assert "--recompute full --recompute-layers 30 --zero-stage 3 --tp 2 --sequence-parallel --dp 2" in suggested
    assert not [s for s in suggested if "--zero-stage" in s and "--tp 4" in s]


def test_no_advice_where_it_fits_and_more_gpus_where_nothing_does(capsys) -> None:
    est, err = _estimate(capsys, "--dp", "8", "--zero-stage", "3", "--recompute", "full")
    assert est["fits"] and "does not fit" not in err
    assert cli.main(["estimate", "--model", "llama3-405b", "--gpu", "h100", "--gpus", "8", "--tp", "8",
                     "--seq", "8192"]) == 0
    err = capsys.readouterr().err
    hint = "orangetron plan --model llama3-405b --gpu h100 --gpus 8 --seq 8192 --global-batch 1"
    assert f"fits; `{hint}` searches every layout of these GPUs, else add GPUs" in err
    assert cli.main(hint.split()[1:]) == 2  # the command it names runs, and finds no layout of 8 GPUs either
    assert "no layout of 8 x h100 fits llama3-405b with seq 8192 and global batch 1" in capsys.readouterr().err


def test_the_plan_command_named_where_nothing_fits_prices_the_same_problem(tmp_path, capsys) -> None:
    """Found by review: the named command dropped the options that change a step's cost, and named a GPU read
    from a file by a preset name that does not exist."""
    import orangetron.spec

    h100 = (Path(orangetron.spec.__file__).parent / "presets" / "gpus" / "h100.toml").read_text()
    gpu = tmp_path / "mygpu.toml"
    gpu.write_text(h100.replace('name = "h100"', 'name = "mygpu"'))
    argv = ["estimate", "--model", "llama3-405b", "--gpu", str(gpu), "--gpus", "8", "--tp", "4", "--pp", "2",
            "--seq", "8192", "--param-dtype", "float32", "--fp8", "--fp8-recipe", "blockwise", "--gpus-per-node", "4"]
    assert cli.main(argv) == 0
    hint = next(line for line in capsys.readouterr().err.splitlines() if "searches every layout" in line)
    assert "`orangetron plan --model llama3-405b --gpu GPU --gpus 8 --seq 8192 --global-batch 1 --gpus-per-node 4 " \
        "--param-dtype float32 --fp8 --fp8-recipe blockwise`" in hint
    edited = tmp_path / "h100.toml"  # a preset's name on other figures is not that preset either
    edited.write_text(h100.replace("memory_gib = 79.65", "memory_gib = 80.65"))
    assert cli.main(["estimate", "--model", "llama3-405b", "--gpu", str(edited), "--gpus", "8", "--tp", "8"]) == 0
    assert "--gpu GPU --gpus 8" in capsys.readouterr().err


DEEPSEEK = ["estimate", "--model", "deepseek-v3", "--gpu", "h800", "--pp", "16", "--dp", "128", "--ep", "64", "--seq",
            "4096", "--global-batch", "15360", "--zero-stage", "1", "--grad-bucket-numel", "40000000", "--dispatcher",
            "deepep", "--fp8", "--fp8-recipe", "blockwise", "--pipeline-layout", "4x15,1"]


def test_delayed_fp8_is_offered_the_blockwise_recipe_with_every_module(capsys) -> None:
    """Under delayed scaling the norms' and the experts' activation replays cannot run: the advice replays the
    others, and offers the blockwise recipe with all four, priced as `estimate` prices it."""
    delayed = [arg for arg in DEEPSEEK if arg not in ("--fp8-recipe", "blockwise")]
    assert cli.main(delayed) == 0
    err = capsys.readouterr().err
    advice = dict(line.strip().split(": ", 1) for line in err.splitlines() if line.startswith("  --"))
    change = "--fp8-recipe blockwise --recompute-modules layernorm,mla_up_proj,mlp,moe_act"
    assert not any("--recompute-modules layernorm" in flags for flags in advice if "blockwise" not in flags)
    assert list(advice)[0] == change
    assert advice[change] == _suggestions(capsys)[change.removeprefix("--fp8-recipe blockwise ")]


def _suggestions(capsys, *flags: str) -> dict[str, str]:
    assert cli.main([*DEEPSEEK, *flags]) == 0
    err = capsys.readouterr().err
    return dict(line.strip().split(": ", 1) for line in err.splitlines() if line.startswith("  --"))


def _priced(capsys, *flags: str) -> str:
    assert cli.main([*DEEPSEEK, *flags, "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert est["fits"], flags
    return f"needs {est['memory_bytes']['needed'] / 2**30:.1f} GiB, step {est['step_time_s']:.3f} s"


def test_module_recompute_is_suggested_and_full_recompute_replaces_it(capsys) -> None:
    """DeepSeek-V3's published layout on 2048 H800: replaying every module the model has (norms, MLA's
    up-projections, the dense MLPs, the experts' activation) fits, and is cheaper than full recompute. With a
    module list given, full recompute is suggested without it (the two do not combine)."""
    modules = "layernorm,mla_up_proj,mlp,moe_act"
    plain = _suggestions(capsys)
    assert list(plain)[0] == f"--recompute-modules {modules}"
    assert plain[f"--recompute-modules {modules}"].startswith(_priced(capsys, "--recompute-modules", modules))
    # full recompute fits on the first 2 layers of each chunk, as plan ranks it: fewer replays are never slower
    partial = "--recompute full --recompute-layers 2"
    assert plain[partial].startswith(_priced(capsys, "--recompute", "full", "--recompute-layers", "2"))
    some = _suggestions(capsys, "--recompute-modules", "mla_up_proj")
    assert some[f"{partial} (no --recompute-modules)"] == plain[partial]
    assert some[f"--recompute-modules {modules}"] == plain[f"--recompute-modules {modules}"]


def test_the_advice_reaches_the_layout_plan_ranks_first(capsys) -> None:
    """Qwen3-30B-A3B on 8 H100 at ep 8 and 8192 tokens: the advice said no change of up to three fits and to add
    GPUs, while `plan`'s first row ran these very degrees with ZeRO-3 reducing every micro-batch and full
    recompute of 42 of the 48 layers. It now tries both (the reduction, and full recompute on the fewest layers
    that fit), and its first suggestion is that row."""
    command = ["estimate", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "8", "--ep", "8", "--seq", "8192",
               "--global-batch", "64"]
    assert cli.main([*command, "--json"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = _each_suggestion_reproduced(capsys, command, est)
    assert cli.main(["plan", *command[1:], "--ep", "8", "--tp", "1", "--pp", "1", "--cp", "1", "--top", "1",
                     "--json"]) == 0
    top = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ranked"][0]
    job = top["job"]
    assert (job["zero_stage"], job["zero3_reduce_every_microbatch"], job["recompute"]) == (3, True, "full")
    assert cli.main(command) == 0
    first = next(line.strip() for line in capsys.readouterr().err.splitlines() if line.startswith("  --"))
    assert first.startswith(f"--recompute full --recompute-layers {job['recompute_layers']} --zero-stage 3 "
                            "--zero3-reduce-every-microbatch:")
    assert steps[0] == top["step_time_s"]
