"""plan -> train in one step: `plan --emit-config` writes a run's config file, `train --config` runs it on CPU
ranks, and what the ranks measure equals what the planner predicted, category by category."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import torch

from orangetron import cli

torch.set_num_threads(1)

PLAN = ["plan", "--model", "tiny", "--gpus", "4", "--seq", "16", "--global-batch", "8", "--param-dtype", "float32",
        "--tp", "2"]


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_plans_config_trains_and_measures_what_was_predicted(tmp_path, capsys) -> None:
    path = tmp_path / "plan.toml"
    assert cli.main([*PLAN, "--emit-config", str(path), "--json"]) == 0
    row = _json(capsys)["ranked"][0]  # the fastest configuration; the trainer runs it (tp2 x dp2)
    assert (row["layout"]["tp"], row["layout"]["dp"]) == (2, 2)
    assert cli.main(["estimate", "--config", str(path), "--json"]) == 0
    priced = _json(capsys)
    assert cli.main(["train", "--config", str(path), "--steps", "2", "--warmup", "0", "--corpus-bytes", "60000",
                     "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["layout"] == {k: row["layout"][k] for k in ("tp", "cp", "pp", "dp", "ep")}

    for memory, traffic, predicted in zip(result["memory"], result["comm_per_step"], result["predicted"],
                                          strict=True):
        assert predicted["memory"] == {k: v for k, v in memory.items() if k != "rank"}
        assert predicted["comm_per_step"] == traffic["train"]
    measured = {k: v for k, v in result["memory"][0].items() if k != "rank"}
    measured["activations"] = measured.pop("activations_peak")
    for plan_memory in (row["memory_bytes"], priced["memory_bytes"]):
        assert {k: plan_memory[k] for k in measured} == measured
    sent = result["comm_per_step"][0]["train"]
    assert priced["comm_bytes"] == sent  # `estimate --config` prices the trainer's step to the byte
    # The plan's ranking leaves out the gradient norm the trainer computes every step: 4 bytes per group.
    gaps = {k: sent[k] - row["comm_bytes"].get(k, 0) for k in sent if sent[k] != row["comm_bytes"].get(k, 0)}
    assert gaps and all(k.startswith("all_reduce/") and v == 4 for k, v in gaps.items())
    # The summary's table shows every category equal: no row carries a difference.
    table = captured.err[captured.err.index("the planner's prediction beside"):]
    assert "memory activations_peak" in table and "sent all_gather/tp" in table and "(+" not in table \
        and "(-" not in table
    # verify checks the planned layout from the same file, leaving out the training run's own options
    assert cli.main(["verify", "--config", str(path), "--steps", "1", "--json"]) == 0
    captured = capsys.readouterr()
    checked = json.loads(captured.out.strip().splitlines()[-1])
    assert checked["ok"] and checked["layout"] == result["layout"] and checked["steps"] == 1
    assert f"--config {path}: leaves out steps, lr, " in captured.err  # it refused the file: unknown key 'lr'


def test_rows_the_trainer_does_not_run_are_passed_over_by_name(tmp_path, capsys) -> None:
    path = tmp_path / "plan.toml"
    code = cli.main([*PLAN, "--emit-config", str(path), "--attention-kernel", "eager"])
    out, err = capsys.readouterr()
    assert code == 2 and "the trainer runs none of the" in err
    assert " 1 " in out.splitlines()[2] and "fastest layouts that fit" in out  # the ranking it refused stays shown
    assert err.count("attention_kernel='eager'") == 1  # one reason, with the ranks it turned away: every one of
    assert "none of the 21 ranked configurations (#1-#21: attention_kernel=" in err  # the 21, not only the top 10
    assert not path.exists()
    longer = [*PLAN[:PLAN.index("--seq")], "--seq", "2048", *PLAN[PLAN.index("--seq") + 2:]]  # tiny: max_seq_len 1024
    assert cli.main([*longer, "--emit-config", str(path)]) == 2  # before: written, then refused once ranks started
    assert "--seq 2048: longer than the model's max_seq_len=1024" in capsys.readouterr().err and not path.exists()
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "tiny"\nseq_len = 16\nwidth = 3\n')
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    assert "unknown key 'width'" in capsys.readouterr().err
    bad.write_text('model = "tiny"\nseq_len = 16\nzero-stge = 2\n')  # a near miss is named, as train names it
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    assert "unknown key 'zero-stge'; did you mean 'zero_stage'?" in capsys.readouterr().err
    # What the file leaves out takes the trainer's defaults (small-moe, seq_len 64, batch_size 8), as train runs it.
    bad.write_text("steps = 5\n")
    assert cli.main(["estimate", "--config", str(bad), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (priced["model"], priced["job"]["seq_len"], priced["job"]["global_batch"]) == ("small-moe", 64, 8)
    bad.write_text('model = "tiny"\nseq_len = "16"\n')
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    assert "seq_len = '16': must be an integer" in capsys.readouterr().err
    # A key only the planner prices names the flag that gives it, and that command prices the file with it.
    bad.write_text('model = "tiny"\nseq_len = 16\nbatch_size = 4\nfp8 = true\n')
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    hint = f"unknown key 'fp8': a planner option, which a run's config file does not hold; give it on the command " \
           f"line (`orangetron estimate --config {bad} --fp8`)"
    assert hint in err and len(err.splitlines()) == 1
    bad.write_text('model = "tiny"\nseq_len = 16\nbatch_size = 4\n')
    assert cli.main(["estimate", "--config", str(bad), "--fp8"]) == 0 and "with fp8" in capsys.readouterr().out
    # So for the expert mesh beyond ep, which estimate --config priced from a file train refuses.
    moe = 'model = "tiny-moe"\nseq_len = 16\nbatch_size = 4\ntp = 2\ndp = 2\nep = 2\nsequence_parallel = true\n'
    bad.write_text(moe + "etp = 2\n")
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    assert "unknown key 'etp': a planner option, which a run's config file does not hold; give it on the command " \
        f"line (`orangetron estimate --config {bad} --etp`)" in capsys.readouterr().err
    bad.write_text(moe)
    assert cli.main(["estimate", "--config", str(bad), "--etp", "2"]) == 0
    assert "tp=2 cp=1 pp=1 dp=2 ep=2 etp=2," in capsys.readouterr().out
    assert cli.main(["estimate", "--config", str(bad), "--etp", "2", "--edp", "1"]) == 0
    assert "ep=2 etp=2 edp=1 (folded)," in capsys.readouterr().out
    # A planner option the file owns under the trainer's name points to that name, not to a flag refused with it.
    bad.write_text('model = "tiny"\nseq_len = 16\nglobal_batch = 4\n')
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    assert "unknown key 'global_batch'; a run's file gives the samples per step as 'batch_size'" in \
        capsys.readouterr().err
    bad.write_text('seq_len = 16\n[model]\nhiden_size = 32\nnum_layers = 1\nnum_heads = 2\n')
    assert cli.main(["estimate", "--config", str(bad)]) == 2
    assert "unknown key(s) hiden_size (did you mean hidden_size?)" in capsys.readouterr().err
    # Values are checked as `train --config` checks them: a switch takes true or false, a degree an integer.
    for line, why in (('zero3_prefetch = "no"', "must be true or false"), ("dp = 2.0", "must be an integer"),
                      ('capacity_factor = "1.0"', "must be a number"), ("capacity_factor = true", "must be a number")):
        bad.write_text(f'model = "tiny"\nseq_len = 16\n{line}\n')
        assert cli.main(["estimate", "--config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1


def test_an_emitted_config_names_the_gpu_it_was_planned_for(tmp_path, capsys) -> None:
    """A run's config has no GPU (the training machine's choice), so the file says which one `plan` priced."""
    path = tmp_path / "plan.toml"
    assert cli.main([*PLAN, "--gpu", "b200", "--emit-config", str(path)]) == 0
    capsys.readouterr()
    header = path.read_text().splitlines()[:2]
    assert "on b200" in header[0] and "--gpu b200" in header[1]
    # estimate --config prices it on that GPU unless told another, and says so
    for flags, gpu in (([], "b200"), (["--gpu", "h100"], "h100")):
        assert cli.main(["estimate", "--config", str(path), "--json", *flags]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out.strip().splitlines()[-1])["gpu"] == gpu
        assert ("note: priced on b200, the GPU `plan` priced the file for" in err) == (not flags)
    # A GPU file, even one that keeps a preset's name, is not taken for the preset: estimate asks for the file.
    from importlib import resources

    mine = tmp_path / "my b200.toml"
    stock = resources.files("orangetron.spec.presets").joinpath("gpus/b200.toml").read_text()
    mine.write_text(stock.replace("nic_gbps = 400.0", "nic_gbps = 200.0"))
    assert cli.main([*PLAN, "--gpu", str(mine), "--emit-config", str(tmp_path / "mine.toml")]) == 0
    capsys.readouterr()
    assert cli.main(["estimate", "--config", str(tmp_path / "mine.toml")]) == 2
    assert "planned for the GPU 'b200 (a GPU file)', which is not a preset: give --gpu" in capsys.readouterr().err
    assert cli.main(["estimate", "--config", str(tmp_path / "mine.toml"), "--gpu", str(mine)]) == 0


def test_estimate_prices_a_run_folders_record(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--batch-size", "4",
                     "--corpus-bytes", "60000", "--out", str(out), "--json", "--quiet"]) == 0
    measured = _json(capsys)["memory"][0]
    assert cli.main(["estimate", "--config", str(out / "config.toml"), "--gpu", "h100", "--json"]) == 0
    priced = _json(capsys)
    assert cli.main(["estimate", "--config", str(out), "--json"]) == 0  # the folder, on the default GPU: the same
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == priced
    assert "note: priced on h100, the default: a run's config names no GPU" in captured.err
    assert priced["memory_bytes"]["params"] == measured["params"] and priced["layout"]["dp"] == 1
    assert priced["memory_bytes"]["activations"] == measured["activations_peak"]


def test_estimate_prices_a_runs_sequence_padded_as_train_pads_it(tmp_path, capsys) -> None:
    """Under cp a seq_len that 2*cp does not divide trains padded at its end; `estimate --config` of such a run
    refused it (`seq_len 32 is not divisible by 2*cp=6`) and now prices the padded length, as train predicts it;
    the options the file leaves out take the trainer's defaults (float32 parameters, not the planner's bfloat16)."""
    from orangetron.train.accounting import predicted_for_rank
    from orangetron.train.config import TrainConfig

    path = tmp_path / "run.toml"
    path.write_text('model = "tiny"\ncp = 3\nseq_len = 32\nbatch_size = 4\n')
    assert cli.main(["estimate", "--config", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: seq_len=32 runs padded to 36 under cp=3, as train pads it" in captured.err
    priced = json.loads(captured.out.strip().splitlines()[-1])
    train_predicts = predicted_for_rank(TrainConfig(model="tiny", cp=3, seq_len=32, batch_size=4), stage=0)
    assert priced["comm_bytes"] == train_predicts["comm_per_step"]
    assert priced["memory_bytes"]["activations"] == train_predicts["memory"]["activations_peak"]


def test_every_rank_is_predicted_on_its_own_stage_and_padded_sequence() -> None:
    """pp 2 x cp 2: each rank's prediction is its own pipeline stage's, on the sequence padded to 2*cp."""
    from orangetron.train.config import TrainConfig
    from orangetron.train.trainer import train

    result = train(TrainConfig(model="tiny", steps=1, seq_len=18, batch_size=4, microbatches=2, pp=2, cp=2,
                               corpus_bytes=60_000, eval_batches=1), progress=False)
    stages = set()
    for memory, traffic, predicted in zip(result["memory"], result["comm_per_step"], result["predicted"],
                                          strict=True):
        assert predicted["memory"] == {k: v for k, v in memory.items() if k != "rank"}
        assert predicted["comm_per_step"] == traffic["train"]
        stages.add(memory["params"])
    assert len(stages) == 2  # the two stages hold different shares of the model


def test_a_packed_run_is_predicted_with_its_rows_own_positions_and_documents(tmp_path) -> None:
    """cp 2 over packed documents of 1 to 39 bytes, rows of 32 (and of 30, padded to 32 as a document of its own):
    every rank's memory equals the prediction (each row keeps RoPE tables of its own), and so do its ring's bytes,
    priced from the last step's own documents.
    Rows with other boundaries are sharded together at all of them: the prediction for one document per
    sequence, which the table showed before, was 29% short on cp rank 1."""
    from orangetron.train.accounting import predicted_for_rank
    from orangetron.train.config import TrainConfig
    from orangetron.train.trainer import train

    g = torch.Generator().manual_seed(5)
    files = []
    for i in range(40):
        files.append(tmp_path / f"doc{i}.txt")
        length = int(torch.randint(1, 40, (), generator=g))
        files[-1].write_text("".join(chr(97 + (i + j) % 26) for j in range(length)))
    for microbatches in (1, 2):
        cfg = TrainConfig(model="tiny", data=[str(f) for f in files], steps=2, warmup=1, seq_len=34 - 2 * microbatches,
                          batch_size=4, microbatches=microbatches, cp=2, pack_documents=True, eval_batches=1)
        result = train(cfg, progress=False)
        for memory, traffic, predicted in zip(result["memory"], result["comm_per_step"], result["predicted"],
                                              strict=True):
            assert predicted["memory"] == {k: v for k, v in memory.items() if k != "rank"}
            assert predicted["comm_per_step"] == traffic["train"], (microbatches, traffic["rank"])
        one_per_sequence = predicted_for_rank(cfg, stage=0, cp_rank=1)["comm_per_step"]["send_recv/cp"]
        assert result["comm_per_step"][1]["train"]["send_recv/cp"] > one_per_sequence


def test_an_option_appended_below_the_model_table_is_named_as_misplaced(tmp_path, capsys) -> None:
    """`echo 'steps = 3' >> plan.toml` puts the key inside [model], the file's last table: both commands that read
    the file say where it belongs, not that the model has no field `steps`."""
    path = tmp_path / "plan.toml"
    assert cli.main([*PLAN, "--emit-config", str(path)]) == 0
    with open(path, "a", encoding="utf-8") as f:
        f.write("steps = 3\n")
    capsys.readouterr()
    for argv in (["train", "--config", str(path)], ["estimate", "--config", str(path), "--gpu", "h100"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "[model] holds steps, an option of the run" in err and "above the [model] line" in err, argv


def test_estimate_of_a_config_refuses_a_gpu_count_its_layout_does_not_have(tmp_path, capsys) -> None:
    path = tmp_path / "plan.toml"
    assert cli.main([*PLAN, "--emit-config", str(path)]) == 0
    world = tomllib.loads(path.read_text())
    gpus = world.get("tp", 1) * world.get("cp", 1) * world.get("pp", 1) * world.get("dp", 1)
    capsys.readouterr()
    assert cli.main(["estimate", "--config", str(path), "--gpu", "h100", "--gpus", str(2 * gpus)]) == 2
    assert f"--gpus {2 * gpus}: the layout of --config" in capsys.readouterr().err
    assert cli.main(["estimate", "--config", str(path), "--gpu", "h100", "--gpus", str(gpus)]) == 0


def test_both_commands_refuse_a_file_whose_batch_does_not_split_over_its_micro_batches(tmp_path, capsys) -> None:
    """`estimate` once rounded the micro-batch down (batch 16 over dp 2 and 3 micro-batches priced as 2 of 2
    rows) and priced a run `train` refuses; both now give train's one line."""
    path = tmp_path / "plan.toml"
    assert cli.main([*PLAN, "--emit-config", str(path)]) == 0
    world = tomllib.loads(path.read_text())
    dp, batch = world.get("dp", 1), world["batch_size"]
    bad = next(m for m in range(2, 64) if batch % (dp * m))
    path.write_text(re.sub(r"(?m)^microbatches = \d+$", f"microbatches = {bad}", path.read_text()))
    capsys.readouterr()
    for argv in (["train", "--config", str(path)], ["estimate", "--config", str(path), "--gpu", "h100"]):
        assert cli.main(argv) == 2, argv
        flag = f"--batch-size, set by --config {path}" if argv[0] == "train" else "--batch-size"
        assert f"batch_size={batch} ({flag}): must divide by dp*microbatches={dp * bad}" in \
            capsys.readouterr().err, argv


def test_both_commands_check_a_files_values_by_trains_own_options(tmp_path, capsys) -> None:
    """`estimate --config` once allowed float16 (a dtype the planner prices) where `train` refuses it, and worded
    the refusal apart; a value now gets the one line `train --config` gives, file and key named."""
    path = tmp_path / "plan.toml"
    assert cli.main([*PLAN, "--emit-config", str(path)]) == 0
    emitted = path.read_text()
    for value, why in (('"float16"', "param_dtype = 'float16': must be one of float32, float64, bfloat16"),
                       ('"ringg"', "cp_mode = 'ringg': must be one of "),
                       ("2.5", "zero_stage = 2.5: must be an integer"),
                       ("64.5", "hidden_size = 64.5: must be an integer")):  # in [model]: named as its table
        key = why.split(" = ")[0]
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", emitted)
        path.write_text(text if f"\n{key} = {value}" in text else f"{key} = {value}\n" + text)
        capsys.readouterr()
        lines = []
        for argv in (["train", "--config", str(path)], ["estimate", "--config", str(path), "--gpu", "h100"]):
            assert cli.main(argv) == 2, argv
            lines.append(capsys.readouterr().err.strip().split(": error: ", 1)[1])
        table = "[model]: model tiny: " if key == "hidden_size" else ""
        assert lines[0] == lines[1] and lines[0].startswith(f"--config {path}: {table}{why}"), lines


def test_a_file_for_the_trainer_is_ranked_and_priced_with_the_overlaps_it_runs(tmp_path, capsys) -> None:
    """The trainer pairs no micro-batches and its shared experts hide the forward combine only: `plan
    --emit-config` ranks without either overlap (said on standard error), and `estimate --config` prices the file
    so whatever its flags say, two micro-batches included."""
    from orangetron.cli.run_config import emit_config
    from orangetron.plan.estimate import estimate
    from orangetron.spec.hardware import make_cluster
    from orangetron.spec.model import load_model
    from orangetron.spec.options import Degrees, Job

    args = ["plan", "--model", "tiny-moe", "--gpus", "4", "--seq", "64", "--global-batch", "16", "--param-dtype",
            "float32", "--ep", "4", "--top", "1", "--json"]
    assert cli.main(args) == 0
    overlapped = _json(capsys)["ranked"][0]
    path = tmp_path / "plan.toml"
    assert cli.main([*args, "--emit-config", str(path)]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out.strip().splitlines()[-1])["ranked"][0]
    assert "ranks as the trainer overlaps the expert all-to-all (--no-overlap-ep --no-overlap-shared-experts): it " \
        "pairs no micro-batches, and its shared experts hide the forward combine only" in err
    assert (row["job"]["overlap_ep"], row["job"]["overlap_shared_experts"]) == (False, False)
    assert row["time_breakdown_s"]["ep_s"] > 2 * overlapped["time_breakdown_s"]["ep_s"] > 0  # nothing hides it
    path.write_text(path.read_text().replace("microbatches = 1\n", "microbatches = 2\n"))  # a pairing to drop
    priced = []
    for flags in ([], ["--no-overlap-ep", "--no-overlap-shared-experts"]):
        assert cli.main(["estimate", "--config", str(path), "--gpu", "h100", "--json", *flags]) == 0
        priced.append(_json(capsys))
    assert priced[0]["job"]["num_microbatches"] == 2 and priced[0]["time_breakdown_s"]["ep_s"] > 0
    assert priced[0] == priced[1]
    unshared = tmp_path / "unshared.toml"  # tiny-moe without its shared expert: the note names none
    model_table = path.read_text().split("[model]\n", 1)[1]
    unshared.write_text(model_table.replace("num_shared_experts = 1", "num_shared_experts = 0"))
    assert cli.main([*args[:2], str(unshared), *args[3:], "--emit-config", str(tmp_path / "u.toml")]) == 0
    err = capsys.readouterr().err
    assert "it pairs no micro-batches\n" in err and "shared experts hide" not in err
    # A library caller's row priced with an overlap the trainer does not run is refused by name.
    model, cluster = load_model("tiny-moe"), make_cluster("h100", 4)
    paired = estimate(model, Degrees(dp=4, ep=4), Job(seq_len=64, micro_batch=2, global_batch=16,
                                                      param_dtype="float32", overlap_shared_experts=False), cluster)
    with pytest.raises(ValueError, match="overlap_ep=True: the trainer runs False only"):
        emit_config([paired], str(tmp_path / "paired.toml"))
    dense = estimate(load_model("tiny"), Degrees(dp=4), Job(seq_len=64, global_batch=16), cluster)  # switches on
    assert emit_config([dense], str(tmp_path / "dense.toml")) == (1, [])  # no all-to-all: they price nothing


def test_the_closing_table_says_when_its_measured_bytes_are_the_last_steps_and_why_they_differ() -> None:
    """An MoE run's steps send what their routing decides: the summary says its bytes are the last step's, and
    why the expert rows differ from the balanced prediction; a run whose steps sent the same says neither."""
    import io

    from orangetron.train.commands import _summary

    def summary(steps_differ: bool, measured: int, key: str = "all_to_all/ep", ep: int = 2, peak: int = 5) -> str:
        memory = {"rank": 0, "params": 10, "activations_peak": peak}
        per_step = {"train": {key: measured}, "eval": {}, "evaluations": 0, "steps_differ": steps_differ}
        result = {"layout": {"ep": ep}, "pack_documents": False, "losses": [2.0, 1.0], "memory": [memory],
                  "eval_loss": None, "final_loss": 1.0,
                  "final_loss_mean10": 1.5, "params": 10, "tokens_per_s": 1.0, "mfu": None, "time_s": 1.0,
                  "comm_per_step": [per_step], "comm": [{"rank": 0}], "warnings": [],
                  "predicted": [{"memory": {"params": 10, "activations_peak": 5},
                                 "comm_per_step": {key: 300}}]}
        out = io.StringIO()
        _summary(result, out)
        return out.getvalue()

    routed = summary(True, 296)
    assert "by op/mesh dim; the last step's: the steps differ): all_to_all/ep 296 B" in routed
    assert "(-4)" in routed and "the planner prices it balanced" in routed
    assert "balanced" not in summary(True, 296, "send_recv/cp")  # no expert row differs: routing is not why
    even = summary(False, 300)
    assert "the steps differ" not in even and "balanced" not in even
    # allgather (or a capacity that drops nothing) sends what the planner prices, and keeps what the routing
    # decides: the activations alone differ, and the note says why (it said nothing)
    gathered = summary(False, 300, peak=7)
    assert "(+2)" in gathered and "the planner prices it balanced" in gathered
    assert "balanced" not in summary(False, 300, ep=1, peak=7)  # no expert parallelism: routing is not why


def test_estimate_and_plan_price_a_given_sequence_padded_as_train_pads_it(tmp_path, capsys) -> None:
    """`estimate --seq 32 --cp 3` and `plan` refused what train runs padded (`not divisible by 2*cp=6`); both now
    price the padded 36 tokens, and a plan's file keeps the 32 asked, which train pads again."""
    flags = ["--model", "tiny", "--gpus", "3", "--param-dtype", "float32", "--global-batch", "4"]
    assert cli.main(["estimate", *flags, "--cp", "3", "--seq", "32", "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: --seq 32 runs padded to 36 under cp=3, as train pads it" in captured.err
    padded = json.loads(captured.out.strip().splitlines()[-1])
    assert cli.main(["estimate", *flags, "--cp", "3", "--seq", "36", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Time, memory and bytes are the padded sequence's; tokens/s and model FLOPs its 32 tokens' (counting the
    # padding read 12.5% more than the trainer counts), and the hardware's FLOPs the 36 it computes.
    same = ("step_time_s", "memory_bytes", "comm_bytes", "job", "hfu")
    assert {k: padded[k] for k in same} == {k: whole[k] for k in same}
    assert padded["tokens_per_s"] == pytest.approx(whole["tokens_per_s"] * 32 / 36, rel=1e-12)
    from orangetron.plan.timing import model_flops_per_step
    from orangetron.spec.model import load_model
    from orangetron.spec.options import Job

    ratio = model_flops_per_step(load_model("tiny"), Job(seq_len=32), 4) / model_flops_per_step(
        load_model("tiny"), Job(seq_len=36), 4)
    assert padded["mfu"] == pytest.approx(whole["mfu"] * ratio, rel=1e-12) and ratio < 32 / 36 + 1e-3
    path = tmp_path / "plan.toml"
    assert cli.main(["plan", *flags, "--cp", "3", "--seq", "32", "--emit-config", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: --seq 32 runs padded to 36 on the rows whose cp ranks cannot split it" in captured.err
    first = json.loads(captured.out.strip().splitlines()[-1])["ranked"][0]
    assert first["layout"]["cp"] == 3 and first["job"]["seq_len"] == 36
    assert first["tokens_per_s"] == pytest.approx(first["job"]["global_batch"] * 32 / first["step_time_s"])
    assert 'seq_len = 32\n' in path.read_text()
    assert cli.main(["estimate", "--config", str(path), "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["memory_bytes"] == first["memory_bytes"] and again["job"]["seq_len"] == 36
    # The advice's command to paste plans the length asked, not the padded one (it said --seq 8004).
    assert cli.main(["estimate", "--model", "llama3-405b", "--gpus", "3", "--cp", "3", "--seq", "8000",
                     "--global-batch", "3"]) == 0
    advice = capsys.readouterr().err
    assert "runs padded to 8004" in advice and "--seq 8000 --global-batch 3" in advice and "--seq 8004" not in advice
    # The file adds the trainer's gradient clipping: one 4-byte norm all-reduce, nothing else.
    assert {k: v for k, v in again["comm_bytes"].items() if k != "all_reduce/dp_cp"} == first["comm_bytes"]
