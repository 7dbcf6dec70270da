"""A command never replaces what it did not write unless asked: `export -o`, `tokenizer train -o` and
`plan --emit-config` refuse an existing output in one line and leave it as it was; `--overwrite` moves it aside.

Workflow tests through the CLI (cli.main, in this process), on one tiny run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from orangetron.cli import main
from orangetron.train.export import read_model

PLAN = ["plan", "--model", "tiny-moe", "--gpus", "4", "--seq", "64", "--global-batch", "8",
        "--param-dtype", "float32"]


def _refused(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outputs") / "run"
    assert main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--batch-size", "4", "--out",
                 str(folder), "--quiet"]) == 0
    return folder


def test_export_refuses_an_existing_file_and_overwrite_moves_it_aside(run, tmp_path, capsys) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    _refused(capsys, ["export", str(run), "-o", str(notes)], "exists; choose another name, or add --overwrite")
    assert notes.read_text() == "my notes\n"
    _refused(capsys, ["sample", str(notes), "--prompt", "x"], "a file; give the run's folder")  # "no such folder"
    assert main(["export", str(run), "-o", str(notes), "--overwrite", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["moved_aside"] == str(tmp_path / "notes.txt.previous-1")
    assert (tmp_path / "notes.txt.previous-1").read_text() == "my notes\n"
    exported = torch.load(notes, weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in read_model(run).state_dict.items())


def test_an_output_whose_folder_cannot_be_written_is_one_line_before_the_work(run, tmp_path, capsys) -> None:
    """Each was a traceback (a PermissionError, or torch's `open file failed`) after the work was done; sysfs
    makes no file, for root too."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no /sys/kernel here")
    (tmp_path / "a.txt").write_text("some text\n")
    for argv, flag, out in ((["export", str(run)], "-o", "/sys/kernel/m.pt"),
                            (["export", str(run), "--hf"], "-o", "/sys/kernel/hf"),
                            (["prepare-data", str(tmp_path / "a.txt")], "-o", "/sys/kernel/ds"),
                            (["tokenizer", "train", str(tmp_path / "a.txt"), "--vocab", "300"], "-o",
                             "/sys/kernel/tok"),
                            (["plan", "--model", "tiny", "--gpus", "4"], "--emit-config", "/sys/kernel/p.toml"),
                            (["plan", "--model", "tiny", "--gpus", "4"], "--chart", "/sys/kernel/c.png")):
        assert main([*argv, flag, out]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert f"error: {flag} {out!r}: cannot write there (" in err and len(err.splitlines()) == 1, argv
    assert main(["export", str(run), "-o", str(tmp_path / "deep" / "m.pt")]) == 0  # its probe made and removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "deep"]  # the probe was made here, as deep was not
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["m.pt"]


def test_an_exported_folders_weights_are_as_readable_as_its_config(run, tmp_path, capsys) -> None:
    """safetensors writes its file owner-only (0600) whatever the umask; the config beside it followed the umask."""
    old = os.umask(0o022)
    try:
        assert main(["export", str(run), "--hf", "-o", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644


def test_a_run_of_a_model_no_family_holds_is_told_which_export_writes_it(tmp_path, capsys) -> None:
    """tiny-moe's ungated shared expert: the refusal named a field the user never set, and nothing to do."""
    run = tmp_path / "moe"
    assert main(["train", "--model", "tiny-moe", "--steps", "1", "--warmup", "0", "--seq-len", "16", "--batch-size",
                 "4", "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "--hf", "-o", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("orangetron export: error: the run's model (tiny-moe) has no Hugging Face form: "
                          "shared_expert_gate=False: ") and len(err.splitlines()) == 1
    assert err.endswith(f"; `orangetron export {run} -o model.pt` writes its state dict")
    assert main(["export", str(run), "-o", str(tmp_path / "model.pt")]) == 0 and not (tmp_path / "hf").exists()


def test_tokenizer_train_refuses_a_tokenizer_already_in_its_folder(tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a folder with a model and no tokenizer takes one
    assert main(["tokenizer", "train", str(text), "-o", str(model), "--vocab", "260"]) == 0
    first = (model / "tokenizer.json").read_text()
    capsys.readouterr()
    _refused(capsys, ["tokenizer", "train", str(text), "-o", str(model), "--vocab", "300"],
             "holds tokenizer.json and tokenizer_config.json already")
    assert (model / "tokenizer.json").read_text() == first
    _refused(capsys, ["tokenizer", "train", str(text), "-o", str(text), "--vocab", "300"], "is a file")
    assert main(["tokenizer", "train", str(text), "-o", str(model), "--vocab", "300", "--overwrite"]) == 0
    assert (model / "tokenizer.json.previous-1").read_text() == first
    assert (model / "tokenizer.json").read_text() != first and (model / "config.json").read_text() == "{}"


def test_emit_config_replaces_only_a_file_plan_wrote(tmp_path, capsys) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    _refused(capsys, [*PLAN, "--emit-config", str(notes)], "exists and is not a configuration `plan` wrote")
    assert notes.read_text() == "my notes\n"
    _refused(capsys, [*PLAN, "--emit-config", str(tmp_path / "no" / "p.toml")], "no such folder")
    emitted = tmp_path / "p.toml"
    assert main([*PLAN, "--emit-config", str(emitted)]) == 0
    assert main([*PLAN, "--top", "1", "--emit-config", str(emitted)]) == 0  # its own file: replaced
    assert emitted.read_text().startswith("# `orangetron plan`'s configuration #1")
    edited = emitted.read_text() + "steps = 5000  # my edit\n"
    emitted.write_text(edited)  # the header still says `plan` wrote it
    capsys.readouterr()
    _refused(capsys, [*PLAN, "--emit-config", str(emitted)], "was edited since `plan` wrote it; give another "
             "name, or add --overwrite to move it aside")
    assert emitted.read_text() == edited
    older = "\n".join(line for line in edited.splitlines() if not line.startswith("# plan replaces this file"))
    emitted.write_text(older)  # an older plan's file: no hash to tell an edit by, not "edited"
    _refused(capsys, [*PLAN, "--emit-config", str(emitted)], "written by an older `plan`")
    # --overwrite, which plan took and ignored here, moves the file aside and says where
    assert main([*PLAN, "--emit-config", str(emitted), "--overwrite"]) == 0
    assert (tmp_path / "p.toml.previous-1").read_text() == older and "# my edit" not in emitted.read_text()
    assert f"wrote {emitted} (the former file moved to {tmp_path / 'p.toml.previous-1'})" in capsys.readouterr().err
    assert main([*PLAN, "--emit-config", str(notes), "--overwrite"]) == 0
    assert (tmp_path / "notes.txt.previous-1").read_text() == "my notes\n"


def test_a_second_tokenizer_overwrite_moves_the_pair_to_one_suffix(tmp_path, capsys) -> None:
    """Each file took its own first free N: tokenizer.json.previous-2 paired with tokenizer_config.json.previous-1."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json.previous-1").write_text("an old tokenizer.json alone")
    assert main(["tokenizer", "train", str(text), "-o", str(folder), "--vocab", "260"]) == 0
    first = {name: (folder / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")}
    assert main(["tokenizer", "train", str(text), "-o", str(folder), "--vocab", "270", "--overwrite"]) == 0
    assert {name: (folder / f"{name}.previous-2").read_text() for name in first} == first
    assert not (folder / "tokenizer_config.json.previous-1").exists()
    capsys.readouterr()
    _refused(capsys, ["tokenizer", "train", str(tmp_path), "-o", str(tmp_path / "t2"), "--vocab", "260"],
             "a folder; give its files")  # it said "no such file"


def test_move_aside_never_replaces_a_link_and_names_a_dot(tmp_path, monkeypatch) -> None:
    from orangetron.train.outputs import free_suffix, move_aside

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    (tmp_path / "notes.txt.previous-1").symlink_to(tmp_path / "nowhere")  # dangling: exists() is False
    assert free_suffix([notes]) == ".previous-2"  # the suffix a pair of files shares, which is not retried
    assert move_aside(notes) == tmp_path / "notes.txt.previous-2"
    assert (tmp_path / "notes.txt.previous-1").is_symlink()
    folder = tmp_path / "here"
    (folder / "sub").mkdir(parents=True)
    monkeypatch.chdir(folder / "sub")
    for working in (Path("."), Path("..")):  # the process follows a moved working folder and writes into it
        with pytest.raises(ValueError, match="holds the working folder, which cannot move aside"):
            move_aside(working)
    assert move_aside(Path("../../notes.txt.previous-2")) == tmp_path / "notes.txt.previous-2.previous-1"
    with pytest.raises(ValueError, match="has no name to move aside"):
        move_aside(Path("/"))


def test_move_aside_never_replaces_what_another_command_moved_there_since(tmp_path, monkeypatch) -> None:
    """Two `--overwrite` commands can both find `.previous-1` free; the second's rename replaced the first's file
    with its own, and the first's old output was lost. Here the name is stale when the move runs."""
    from orangetron.train import outputs

    monkeypatch.setattr(outputs, "free_suffix", lambda paths, start=1: f".previous-{start}")  # free, it thinks
    for kind in ("file", "folder", "link"):
        mine, theirs = tmp_path / kind, tmp_path / f"{kind}.previous-1"
        theirs.write_text("theirs") if kind != "folder" else (theirs / "sub").mkdir(parents=True)
        if kind == "link":
            mine.symlink_to(tmp_path / "nowhere")
        elif kind == "file":
            mine.write_text("mine")
        else:
            (mine / "sub").mkdir(parents=True)
        assert outputs.move_aside(mine) == tmp_path / f"{kind}.previous-2"
        assert not os.path.lexists(mine)
        assert theirs.is_dir() if kind == "folder" else theirs.read_text() == "theirs"
    (tmp_path / "file").write_text("again")
    with pytest.raises(ValueError, match="could not move it aside: file.previous-1 exists"):
        outputs.move_aside(tmp_path / "file", ".previous-1")  # a suffix given (a pair of files) is kept
    assert (tmp_path / "file.previous-1").read_text() == "theirs" and (tmp_path / "file").read_text() == "again"
    assert (tmp_path / "link.previous-2").is_symlink() and (tmp_path / "file.previous-2").read_text() == "mine"


def test_a_new_run_over_the_working_folder_moves_nothing(tmp_path, monkeypatch, capsys) -> None:
    """`train --out . --overwrite` moved the working folder aside and the new run, following it, wrote over the
    old one inside it."""
    monkeypatch.chdir(tmp_path)
    base = ["train", "--model", "tiny", "--steps", "1", "--seq-len", "16", "--batch-size", "4", "--quiet", "--out", "."]
    assert main([*base, "--seed", "1"]) == 0
    before = (tmp_path / "config.toml").read_text()
    capsys.readouterr()
    _refused(capsys, [*base, "--seed", "2", "--overwrite"], "holds the working folder, which cannot move aside")
    assert (tmp_path / "config.toml").read_text() == before


def test_an_export_that_fails_moves_nothing_aside_and_leaves_nothing(run, tmp_path, capsys, monkeypatch) -> None:
    """The old export moved aside before the new one was written, so a refused config left an empty folder."""
    from orangetron.hf import io as hf_io
    from orangetron.spec.hf_config import HFConfigError

    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", "-o", str(out)]) == 0
    before = sorted(p.name for p in out.iterdir())
    # a run on bytes exports no tokenizer: said, not left for AutoTokenizer to find
    assert "tokenizer.json" not in before and "warning: the run trained on bytes" in capsys.readouterr().err

    def refuse(*args, **kwargs):
        raise HFConfigError("no family here holds it")

    monkeypatch.setattr(hf_io, "save", refuse)
    _refused(capsys, ["export", str(run), "--hf", "-o", str(out), "--overwrite"], "no family here holds it")
    assert sorted(p.name for p in out.iterdir()) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    _refused(capsys, ["export", str(run), "--hf", "-o", str(run.parent), "--overwrite"],
             "holds the checkpoint")  # it moved the run folder away, with every checkpoint
    assert (run / "checkpoints").is_dir()


def test_a_state_dict_export_that_fails_moves_nothing_and_makes_its_folder(run, tmp_path, capsys, monkeypatch):
    """The old file moved aside before the new one was written; and a missing folder ended in a traceback."""
    assert main(["export", str(run), "-o", str(tmp_path / "new" / "sub" / "m.pt")]) == 0
    exported = tmp_path / "new" / "sub" / "m.pt"
    before = exported.read_bytes()

    def refuse(*args, **kwargs):
        raise ValueError("disk full")

    monkeypatch.setattr(torch, "save", refuse)
    capsys.readouterr()
    _refused(capsys, ["export", str(run), "-o", str(exported), "--overwrite"], "disk full")
    assert exported.read_bytes() == before and sorted(p.name for p in exported.parent.iterdir()) == ["m.pt"]


def test_an_export_into_a_link_writes_its_target(run, tmp_path, capsys) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert main(["export", str(run), "--hf", "-o", str(tmp_path / "link")]) == 0  # it ended in a traceback
    assert (tmp_path / "target" / "model.safetensors").is_file() and (tmp_path / "link").is_symlink()


def test_a_run_given_for_a_model_or_tokenizer_and_a_model_for_a_run_say_which_it_is(run, tmp_path, capsys) -> None:
    """Each said only what the folder lacked (no config.json, no tokenizer.json, no checkpoint)."""
    _refused(capsys, ["train", "--model", str(run), "--steps", "1"],
             f"(--model): a run's folder, not a model: --config {run / 'config.toml'} repeats its run, --resume "
             f"--out {run} continues it")
    _refused(capsys, ["prepare-data", "--tokenizer", str(run), "-o", str(tmp_path / "data"), str(run / "config.toml")],
             f"(a run's folder: `orangetron tokenizer export {run} -o DIR` writes the tokenizer its checkpoint keeps)")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    _refused(capsys, ["export", str(tmp_path / "model"), "--hf", "-o", str(tmp_path / "out")],
             f"a Hugging Face model folder, not a run (no checkpoint under {tmp_path / 'model' / 'checkpoints'}); "
             f"`orangetron train --hf-model {tmp_path / 'model'}` trains from it")
    _refused(capsys, ["export", str(run), "--hf", "-o", str(tmp_path / "model.safetensors")],
             "--hf writes a folder (config.json, model.safetensors and the tokenizer), not a file")
    assert not (tmp_path / "model.safetensors").exists()  # it became a folder of that name
