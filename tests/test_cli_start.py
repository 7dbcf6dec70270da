"""The command line answers `--help` and argument errors without importing torch (seconds on a cold start)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from orangetron.cli import main
try:
    main({argv!r})
except SystemExit as exit:
    code = exit.code
print("torch" in sys.modules, code)
"""


def _probe(argv: list[str]) -> tuple[bool, int]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          check=True)
    imported, code = done.stdout.splitlines()[-1].split()  # after the help text
    return imported == "True", int(code)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["verify", "--help"], ["plan", "--help"],
                                  ["estimate", "--help"], ["schedule", "--help"], ["export", "--help"],
                                  ["sample", "--help"], ["prepare-data", "--help"], ["tokenizer", "train", "--help"],
                                  ["presets", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    assert _probe(argv) == (False, 0)


def test_a_malformed_flag_is_refused_before_torch_loads() -> None:
    assert _probe(["train", "--steps", "many"]) == (False, 2)


def test_the_cli_names_the_dtypes_the_runtime_knows() -> None:
    from orangetron.parallel.config import DTYPES
    from orangetron.train.config import PARAM_DTYPES

    assert sorted(PARAM_DTYPES) == sorted(DTYPES)
