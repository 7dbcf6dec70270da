"""`estimate` explains a configuration that does not fit: its largest categories and the changes that fit."""

from __future__ import annotations

import json
import shlex

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
    suggested = [line.strip() for line in err.splitlines() if line.startswith("  --")]
    assert len(suggested) == 3
    steps = []
    for line in suggested:  # each suggestion, run as flags on its own, fits and costs what it says
        flags, figures = line.split(": ", 1)
        args = shlex.split(flags)
        for dim in ("--tp", "--pp"):  # a larger tp or pp takes its GPUs from dp
            if dim in args:
                factor = int(args[args.index(dim) + 1])
                args += ["--dp", str(8 // factor)]
        if "--dp" not in args:
            args += ["--dp", "8"]
        fixed, _ = _estimate(capsys, *args)
        assert fixed["fits"], line
        assert figures.startswith(f"needs {fixed['memory_bytes']['needed'] / 2**30:.1f} GiB, step "
                                  f"{fixed['step_time_s']:.3f} s"), line
        steps.append(fixed["step_time_s"])
    assert steps == sorted(steps)  # fastest first
    known, _ = _estimate(capsys, "--dp", "8", "--zero-stage", "3", "--recompute", "full")  # a fit by hand
    assert known["fits"] and steps[0] <= known["step_time_s"]  # nothing faster was passed over for it


def test_no_zero_stage_is_suggested_where_the_change_leaves_no_data_parallel_ranks(capsys) -> None:
    """Llama 3 8B at 65536 tokens on 4 GPUs: tp 4 leaves dp 1, where a ZeRO stage shards nothing, so no suggestion
    pairs them (it would repeat the suggestion without it); ZeRO stays suggested beside a tp 2. The overhead the
    layout needs (fixed, and 2% of 350 GiB of activations and buffers) is not among its largest categories, though
    the 19% it would reserve with room to spare (68 GiB) would be."""
    assert cli.main(["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "4", "--dp", "4", "--seq",
                     "65536", "--global-batch", "4"]) == 0
    err = capsys.readouterr().err
    assert "largest: activations 304.6, optimizer 59.8, buffers 44.9 GiB" in err
    suggested = [line.split(":")[0].strip() for line in err.splitlines() if line.startswith("  --")]
    assert "--recompute full --tp 4" in suggested and "--recompute full --zero-stage 3 --tp 2" in suggested
    assert not [s for s in suggested if "--zero-stage" in s and "--tp 4" in s]


def test_no_advice_where_it_fits_and_more_gpus_where_nothing_does(capsys) -> None:
    est, err = _estimate(capsys, "--dp", "8", "--zero-stage", "3", "--recompute", "full")
    assert est["fits"] and "does not fit" not in err
    assert cli.main(["estimate", "--model", "llama3-405b", "--gpu", "h100", "--gpus", "8", "--tp", "8",
                     "--seq", "8192"]) == 0
    assert "fits; add GPUs" in capsys.readouterr().err


DEEPSEEK = ["estimate", "--model", "deepseek-v3", "--gpu", "h800", "--pp", "16", "--dp", "128", "--ep", "64", "--seq",
            "4096", "--global-batch", "15360", "--zero-stage", "1", "--dispatcher", "deepep", "--fp8",
            "--fp8-recipe", "blockwise", "--pipeline-layout", "4x15,1"]


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
    assert plain["--recompute full"].startswith(_priced(capsys, "--recompute", "full"))
    some = _suggestions(capsys, "--recompute-modules", "mla_up_proj")
    assert some["--recompute full (no --recompute-modules)"] == plain["--recompute full"]
    assert some[f"--recompute-modules {modules}"] == plain[f"--recompute-modules {modules}"]
