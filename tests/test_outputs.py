"""A command never replaces what it did not write unless asked: `export -o`, `tokenizer train -o` and
`plan --emit-config` refuse an existing output in one line and leave it as it was; `--overwrite` moves it aside.

Workflow tests through the CLI (cli.main, in this process), on one tiny run."""

from __future__ import annotations

import json

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
    assert main(["export", str(run), "-o", str(notes), "--overwrite", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["moved_aside"] == str(tmp_path / "notes.txt.previous-1")
    assert (tmp_path / "notes.txt.previous-1").read_text() == "my notes\n"
    exported = torch.load(notes, weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in read_model(run).state_dict.items())


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
