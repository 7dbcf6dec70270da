"""What a run shows and keeps: --config files, the run folder's files, the global-batch loss, MFU."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch

from orangetron import cli
from orangetron.model.config import model_preset
from orangetron.train.config import TrainConfig
from orangetron.train.trainer import train

torch.set_num_threads(1)

TINY = dict(model="tiny-moe", steps=3, seq_len=32, batch_size=4, warmup=1, eval_batches=2, corpus_bytes=200_000)


def _cli_config(monkeypatch, argv: list[str]) -> TrainConfig:
    """The TrainConfig `orangetron train argv` would run (train itself replaced)."""
    from orangetron.train import trainer

    seen = {}

    def fake_train(cfg, progress=True):
        seen["cfg"] = cfg
        return {"losses": [1.0], "final_loss": 1.0, "final_loss_mean10": 1.0, "eval_loss": None, "params": 1,
                "tokens_per_s": 1.0, "mfu": None, "time_s": 0.0, "memory": [{}], "comm": [{}]}

    monkeypatch.setattr(trainer, "train", fake_train)
    assert cli.main(["train", "--quiet", *argv]) == 0
    return seen["cfg"]


def test_config_file_sets_options_and_the_command_line_overrides_it(monkeypatch, tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nzero-stage = 2\ndp = 2\nbatch_size = 4\ncp_mode = "ulysses"\nsequence-parallel = '
                    f'true\nlr = 1\ndata = "{path}"\n')
    cfg = _cli_config(monkeypatch, ["--config", str(path), "--steps", "9"])
    assert (cfg.steps, cfg.zero_stage, cfg.dp, cfg.batch_size) == (9, 2, 2, 4)
    assert cfg.cp_mode == "ulysses" and cfg.sequence_parallel is True
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.min_lr == 0.1  # lr/10 unless given
    assert cfg.data == (str(path),)
    assert _cli_config(monkeypatch, ["--steps", "9"]).zero_stage == 0  # nothing leaks into the next parse
    path.write_text("zero3_prefetch = false\n")
    assert _cli_config(monkeypatch, ["--config", str(path)]).zero3_prefetch is False
    assert _cli_config(monkeypatch, ["--config", str(path), "--zero3-prefetch"]).zero3_prefetch is True



SWITCHES = ("sequence_parallel", "distributed_optimizer", "zero3_keep_params", "zero3_reduce_every_microbatch",
            "deterministic")


def test_a_switch_a_file_or_a_record_turned_on_is_turned_off_by_its_negation(monkeypatch, tmp_path) -> None:
    """A resume reads its record as a --config file does: a switch it holds on (sequence parallelism kept from a
    tp 2 run resumed at tp 1, warned of at every start) must be one the command line can turn off."""
    from orangetron.cli.wording import flags_of

    # The distributed optimizer is ZeRO-1's, the other two ZeRO-3's: two files hold every switch.
    zero3 = ("sequence_parallel", "zero3_keep_params", "zero3_reduce_every_microbatch", "deterministic")
    for switches, stage in ((zero3, 3), (("distributed_optimizer",), 1)):
        path = tmp_path / "run.toml"
        path.write_text("".join(f"{name} = true\n" for name in switches) + f"tp = 2\ndp = 2\nzero_stage = {stage}\n")
        on = _cli_config(monkeypatch, ["--config", str(path)])
        assert all(getattr(on, name) is True for name in switches)
        negations = [f"--no-{name.replace('_', '-')}" for name in switches]
        off = _cli_config(monkeypatch, ["--config", str(path), *negations])
        assert not any(getattr(off, name) for name in switches)
    # A rule's message names the flag that turns the switch on, not its negation.
    flags = flags_of(cli.build_parser()._subparsers._group_actions[0].choices["train"])
    assert [flags[name] for name in SWITCHES] == [f"--{name.replace('_', '-')}" for name in SWITCHES]
    idle = TrainConfig(**{**TINY, "sequence_parallel": True}).ineffective_options()
    assert idle == ["sequence_parallel=True (--sequence-parallel) has no effect: needs --tp > 1 "
                    "(--no-sequence-parallel turns it off)"]


# config.toml as a run folder held it before `dtype` became `param_dtype` (the flag `--dtype` still names it).
OLD_RESOLVED_CONFIG = """# The resolved options of this run: `orangetron train --config` on this file repeats it.
model = "tiny-moe"
steps = 3
seq_len = 32
batch_size = 4
lr = 0.002
warmup = 20
min_lr = 0.0002
weight_decay = 0.1
grad_clip = 1.0
seed = 0
eval_every = 0
eval_batches = 16
eval_fraction = 0.05
dtype = "float64"
corpus_bytes = 2000000
out = "OUT"
save_every = 0
resume = false
extend = false
stop_after = 0
threads = 1
timeout_s = 45.0
tp = 1
cp = 1
pp = 1
pp_schedule = "1f1b"
microbatches = 1
virtual_stages = 1
dp = 2
ep = 1
dispatcher = "ragged"
capacity_factor = 1.0
ep_overlap_chunks = 1
zero_stage = 1
distributed_optimizer = false
grad_bucket_numel = 0
zero3_prefetch = true
zero3_keep_params = false
zero3_reduce_every_microbatch = false
sequence_parallel = false
cp_mode = "ring"
ulysses_degree = 1
"""


def test_an_old_run_folders_config_file_still_reads(monkeypatch, tmp_path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(OLD_RESOLVED_CONFIG.replace("OUT", str(tmp_path / "run")))
    cfg = _cli_config(monkeypatch, ["--config", str(path)])
    assert cfg == TrainConfig(model="tiny-moe", steps=3, seq_len=32, batch_size=4, warmup=20, min_lr=0.0002,
                              out=str(tmp_path / "run"), dp=2, zero_stage=1, param_dtype="float64")
    path.write_text('param-dtype = "bfloat16"\n')
    assert _cli_config(monkeypatch, ["--config", str(path)]).param_dtype == "bfloat16"
    assert _cli_config(monkeypatch, ["--dtype", "float64"]).param_dtype == "float64"  # the old flag


def test_every_option_is_a_flag_but_the_few_train_leaves_at_their_defaults() -> None:
    """config.toml holds `options()`; `--config` reads back only flags. The inherited fields without one are
    written only when set (WITHOUT_FLAGS); nothing else may lack a flag."""
    from dataclasses import fields

    from orangetron.cli import build_parser
    from orangetron.train.config import WITHOUT_FLAGS

    dests = set(vars(build_parser().parse_args(["train"])))  # every flag's destination, at its default
    lacking = {f.name for f in fields(TrainConfig)} - dests
    assert lacking == set(WITHOUT_FLAGS)
    assert not set(WITHOUT_FLAGS) & set(TrainConfig().options())


def test_drop_policy_and_reduce_dtype_are_flags_that_reach_the_runtime_and_its_record(monkeypatch, tmp_path) -> None:
    """Both go to the runtime and into config.toml, which `--config` (and so `--resume`) reads back."""
    from orangetron.parallel import ParallelConfig
    from orangetron.train.config_file import write_resolved_config

    cfg = _cli_config(monkeypatch, ["--dp", "2", "--ep", "2", "--model", "tiny-moe", "--dispatcher", "capacity",
                                    "--drop-policy", "position", "--reduce-dtype", "float64"])
    assert cfg.parallel_config() == ParallelConfig(dispatcher="capacity", drop_policy="position",
                                                   reduce_dtype="float64")
    assert {"drop_policy": "position", "reduce_dtype": "float64"}.items() <= cfg.options().items()
    path = tmp_path / "config.toml"
    write_resolved_config(path, {k: v for k, v in cfg.options().items() if k != "model"})
    again = _cli_config(monkeypatch, ["--config", str(path), "--model", "tiny-moe"])
    assert (again.drop_policy, again.reduce_dtype) == ("position", "float64")


@pytest.mark.parametrize(("text", "needle"), [
    ("zero_stge = 2\n", "unknown key 'zero_stge'; did you mean 'zero_stage'?"),
    ("seq-lenght = 64\n", "did you mean 'seq_len'?"),
    ("steps = \"10\"\n", "steps = '10': must be an integer"),
    ("lr = true\n", "must be a number"),
    ("cp_mode = \"spiral\"\n", "must be one of ring"),
    ("resume = 1\n", "must be true or false"),
    ("no_zero3_prefetch = true\n", "unknown key 'no_zero3_prefetch'; did you mean 'zero3_prefetch'?"),
    ("steps = [\n", "not a TOML file"),
    ("[steps]\nx = 1\n", "a table"),
    ("[train]\nsteps = 1\n", "unknown table [train]; options go at the top of the file"),
    # A key only the planner prices names the planner's flag instead of a near miss among the trainer's keys.
    ("fp8 = true\n", "unknown key 'fp8': a planner option (`orangetron estimate --fp8`), which the trainer"),
    ("recompute-modules = [\"mlp\"]\n", "unknown key 'recompute-modules': a planner option (`orangetron "
                                          "estimate --recompute-modules`)"),
    # the expert mesh beyond ep was suggested as 'tp' and 'ep'
    ("etp = 2\n", "unknown key 'etp': a planner option (`orangetron estimate --etp`), which the trainer"),
    ("edp = 2\n", "unknown key 'edp': a planner option (`orangetron estimate --edp`), which the trainer"),
    # A file used again would move a run aside on every use: --overwrite is for one invocation.
    ("overwrite = true\n", "overwrite: moves the run in --out aside, so it is given on the command line"),
    # The planner's names for what a run's file holds under the trainer's names point to those names.
    ("global_batch = 8\n", "unknown key 'global_batch'; a run's file gives the samples per step as 'batch_size'"),
    ("micro_batch = 2\n", "unknown key 'micro_batch'; a run's file gives the micro-batches per step as "
                          "'microbatches'"),
    # The emitted file's header says `--gpu h100` priced it; the GPU is no key of a run's file.
    ("gpu = \"h100\"\n", "unknown key 'gpu'; a run's file names no GPU: train runs on the devices it finds"),
])
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, capsys, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_verify_reads_config_files_too(tmp_path, capsys) -> None:
    path = tmp_path / "v.toml"
    path.write_text("dp = 2\nzero_stge = 1\n")
    assert cli.main(["verify", "--config", str(path)]) == 2
    assert "did you mean 'zero_stage'?" in capsys.readouterr().err


def test_run_folder_keeps_config_metrics_and_loss_curve(monkeypatch, tmp_path, capfd) -> None:
    out = tmp_path / "run"
    result = train(TrainConfig(**TINY, out=str(out), dp=2, zero_stage=1, param_dtype="float64"), progress=True)
    err = capfd.readouterr().err  # rank 0 is a child process: its standard error is the file descriptor
    for name in ("config.toml", "metrics.jsonl", "loss.png"):
        assert f"wrote {out / name}" in err
    assert f"wrote checkpoint {out / 'checkpoints' / 'step-00000003'}" in err
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["dp"] == 2 and saved["zero_stage"] == 1 and saved["param_dtype"] == "float64"
    # The resolved file is a valid --config: the command line rebuilds the same run from it, the model from
    # its [model] table.
    again = _cli_config(monkeypatch, ["--config", str(out / "config.toml")])
    assert again == TrainConfig(**{**TINY, "model": model_preset("tiny-moe")}, out=str(out), dp=2, zero_stage=1,
                                param_dtype="float64")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == result["losses"]
    assert all(r["step_mfu"] > 0 for r in records) and result["mfu"] > 0 and result["peak_flops"] > 0


def test_every_layout_shows_the_global_batch_loss(tmp_path) -> None:
    """The bar and metrics.jsonl show the whole batch's loss, not rank 0's share of it."""
    one = train(TrainConfig(**TINY, param_dtype="float64", out=str(tmp_path / "one")), progress=False)
    two = train(TrainConfig(**TINY, param_dtype="float64", dp=2, out=str(tmp_path / "two")), progress=False)
    shown = [json.loads(line)["loss"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert shown == pytest.approx(one["losses"], rel=1e-12, abs=0)
    assert two["losses"] == shown


def test_step_flops_is_the_hand_count_of_the_tiny_model() -> None:
    from orangetron.train.mfu import step_flops

    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=4, corpus_bytes=200_000)
    tokens, s, dim, kv_dim, ffn, vocab, layers = 4 * 32, 32, 64, 32, 192, 256, 2
    layer_params = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn + 2 * dim  # q, o, k, v, SwiGLU, two norms
    matmuls = 2 * tokens * layer_params * layers + 2 * tokens * dim * vocab
    attention = 2 * tokens * s * 4 * (16 + 16) * layers  # QK^T and AV over every key, 4 heads of 16
    assert step_flops(cfg) == 3 * (matmuls + attention)  # forward plus a backward of twice its cost


def test_no_output_is_written_inside_a_runs_checkpoints(tmp_path, capsys) -> None:
    """A folder written there as step-N was taken for the newest checkpoint: the run could be neither resumed
    nor sampled (train --out has its own refusal, tests/test_run_folder.py)."""
    run, text = tmp_path / "run", tmp_path / "a.txt"
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--batch-size", "4",
                     "--corpus-bytes", "50000", "--out", str(run), "--quiet"]) == 0
    text.write_text("a few words of text to read\n" * 40)
    inside = run / "checkpoints" / "step-99999999"
    for argv in (["export", str(run), "--hf", "-o", str(inside)], ["export", str(run), "-o", str(inside / "m.pt")],
                 ["tokenizer", "train", str(text), "--vocab", "300", "-o", str(inside)],
                 ["prepare-data", str(text), "-o", str(inside)]):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"inside {(run / 'checkpoints').resolve()}, a run's checkpoints" in err and not inside.exists(), err
    assert cli.main(["sample", str(run), "--prompt", "a", "--max-new-tokens", "2"]) == 0
    # the checkpoints folder itself stands for its latest (it was "no checkpoint under .../checkpoints/checkpoints")
    assert cli.main(["sample", str(run / "checkpoints"), "--prompt", "a", "--max-new-tokens", "2"]) == 0
