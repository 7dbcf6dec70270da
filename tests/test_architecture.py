"""Imports run one way: spec <- runtime, spec <- plan, and the CLI (with train/) over both.

Every import statement is scanned, those inside functions included, so that a lazy import cannot carry the
planner into the runtime or torch into the spec layer.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "orangetron"
RUNTIME = ("comm", "mesh", "memory", "testing", "host_syncs", "model", "parallel", "hf")
CLI = ("cli", "train", "__init__", "__main__")
# What each layer may import from orangetron; third-party packages checked apart.
ALLOWED = {"spec": {"spec"}, "plan": {"spec", "plan"}, "runtime": {"spec", *RUNTIME}}
TORCH_FREE = ("spec", "plan")


def _layer(path: Path) -> str:
    top = path.relative_to(SRC).parts[0].removesuffix(".py")
    if top in ("spec", "plan"):
        return top
    return "runtime" if top in RUNTIME else "cli"


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            if node.module == "orangetron":  # `from orangetron import comm`
                out += [(node.lineno, f"orangetron.{alias.name}") for alias in node.names]
    return out


def _violations() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        layer = _layer(path)
        for line, module in _imports(path):
            parts = module.split(".")
            where = f"{path.relative_to(SRC.parent)}:{line} imports {module}"
            if layer in TORCH_FREE and parts[0] == "torch":
                found.append(f"{where} (the {layer} layer is torch-free)")
            if parts[0] != "orangetron" or len(parts) == 1 or layer == "cli":
                continue
            if parts[1] not in ALLOWED[layer]:
                found.append(f"{where} (the {layer} layer may import only {', '.join(sorted(ALLOWED[layer]))})")
    return found


def test_imports_run_one_way():
    assert _violations() == []


@pytest.mark.parametrize("source, layer", [("import torch\n", "spec"), ("from orangetron.plan import x\n", "runtime"),
                                           ("def f():\n    from orangetron.parallel import y\n", "plan"),
                                           ("def f():\n    import orangetron.train.step\n", "spec")])
def test_the_scan_sees_a_planted_import(tmp_path, monkeypatch, source, layer):
    folder = {"runtime": "parallel"}.get(layer, layer)
    planted = tmp_path / "orangetron" / folder / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "orangetron")
    assert any("planted.py" in v for v in _violations())


# A path in a comment or docstring: docs/x.md, tests/x.py, benchmarks/..., scripts/..., or a module under the package.
_PATH_IN_TEXT = re.compile(r"(?<![\w/.])((?:docs|tests|benchmarks|scripts)/[\w./-]+\.(?:md|py|toml|jsonl)"
                           r"|(?:spec|plan|parallel|model|train|cli)/[\w/]+\.py)")
_OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|\bseed/|\.\./shared")


def test_comments_point_only_to_files_in_this_repository():
    repo = Path(__file__).resolve().parents[1]
    package = repo / "src" / "orangetron"
    dangling, outside = [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(repo).as_posix()
        outside += [f"{where}: {m.group(0)}" for m in _OUTSIDE.finditer(text)]
        dangling += [f"{where}: {m.group(1)}" for m in _PATH_IN_TEXT.finditer(text)
                     if not (repo / m.group(1)).exists() and not (package / m.group(1)).exists()]
    assert outside == [], "comments cite documents outside the repository"
    assert dangling == [], "comments name files that do not exist"
