"""The README's Hugging Face block, run as it is: estimate the folder, prepare data with its tokenizer, train on
tp2 x dp2 from its weights, sample, export, and load the export in transformers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _block() -> str:
    readme = (REPO / "README.md").read_text()
    marker = readme.index("<!-- hf-walkthrough:")
    return re.search(r"```bash\n(.*?)```", readme[marker:], re.S).group(1)


def test_the_readme_hf_block_runs(tmp_path):
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "orangetron").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m orangetron "$@"\n')
    (bin_dir / "orangetron").chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    folder = hf_models.llama(tmp_path / "my-llama")
    hf_models.add_tokenizer(folder)
    text = hf_models.corpus_file(tmp_path / "src").read_text()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text[i:i + 3000]}) + "\n"
                                                 for i in range(0, 30_000, 3000)))
    (tmp_path / "notes.txt").write_text(text[30_000:])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["bash", "-e", "-c", _block()], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((tmp_path / "data" / "mine" / "dataset.json").read_text())
    assert meta["documents"] == 11 and meta["tokenizer"] == str(folder.resolve())
    record = tomllib.loads((tmp_path / "runs" / "llama" / "config.toml").read_text())
    assert record["data_record"]["source"] == "prepared" and record["model_source"]["path"] == str(folder.resolve())
    exported = tmp_path / "my-llama-trained"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in exported.iterdir()}
