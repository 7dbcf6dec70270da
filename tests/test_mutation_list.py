"""The mutation list plants what it says: every mutant's snippet stands once in its file, and its tests exist.

A snippet that the code no longer holds (a constant refitted, a line reworded, a function moved) would make
`scripts/mutate.py` refuse the whole list, and a mutant that is never planted kills nothing."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutate.py"


def test_every_mutant_snippet_stands_once_in_its_file() -> None:
    spec = importlib.util.spec_from_file_location("mutate", SCRIPT)
    mutate = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutate", mutate)  # its dataclasses look their module up there
    spec.loader.exec_module(mutate)
    assert mutate.check(mutate.MUTANTS) == []
    assert len({m.name for m in mutate.MUTANTS}) == len(mutate.MUTANTS)  # a name reports one mutant
