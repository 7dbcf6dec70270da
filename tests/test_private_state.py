"""No module of the parallel runtime reads or writes another object's private state (`x._name` where x is not
`self` or `cls`, or `getattr(x, "_name")`): what two pieces share belongs on an object both receive.

Every module under src/orangetron/parallel/ is scanned; the allowlist below names, by file, the only accesses
that remain and why.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PARALLEL = Path(__file__).resolve().parents[1] / "src" / "orangetron" / "parallel"
# Private names of objects outside orangetron, with no public equivalent; by file under parallel/.
ALLOWED = {
    # torch has no public way to run a callback once the current backward pass ends (FSDP2 uses the same).
    "data/units.py": {"torch.autograd.Variable._execution_engine"},
    # torch's fused AdamW kernel over a list of tensors (what torch.optim.AdamW(fused=True) calls): the optimizer
    # class itself cannot update views of one flat shard in place with per-run weight decay. Read with getattr so
    # that a torch without it takes the unfused update instead.
    "data/optim.py": {"getattr(torch, '_fused_adamw_', None)"},
    # torch has no public device-side assert that does not wait: checking token ids on the host would make the GPU
    # wait for it at every forward (`refuse_outside_vocab`; on CPU the check is made on the host).
    "tensor.py": {"torch._assert_async"},
}
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _reaches_in(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute):  # x._name
        return _private(node.attr) and not _own(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS:
        args = node.args  # getattr(x, "_name")
        return (len(args) >= 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
                and _private(args[1].value) and not _own(args[0]))
    return False


def _accesses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of every private attribute of another object that `tree` touches."""
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(tree) if _reaches_in(node)]


def _violations() -> list[str]:
    found = []
    for path in sorted(PARALLEL.rglob("*.py")):
        where = path.relative_to(PARALLEL).as_posix()
        for line, expression in _accesses(ast.parse(path.read_text(), str(path))):
            if expression not in ALLOWED.get(where, set()):
                found.append(f"parallel/{where}:{line}: {expression}")
    return found


def test_no_parallel_module_reaches_into_another_objects_private_state():
    assert _violations() == []


def test_every_allowed_access_still_exists():
    """An entry of the allowlist whose access is gone must leave the list too."""
    for where, expressions in ALLOWED.items():
        tree = ast.parse((PARALLEL / where).read_text())
        assert expressions <= {expression for _, expression in _accesses(tree)}, where


@pytest.mark.parametrize("source, flagged", [
    ("def f(dp):\n    return dp._named\n", True),
    ("class A:\n    def f(self):\n        return self.dp._named\n", True),
    ("def f(buckets):\n    buckets._launch(0)\n", True),
    ("def f(x):\n    return getattr(x, '_secret')\n", True),
    ("class A:\n    def f(self):\n        return self._mine + type(self).__name__.__len__()\n", False),
    ("class A:\n    @classmethod\n    def f(cls):\n        return cls._registry\n", False),
])
def test_the_scan_sees_a_planted_access(tmp_path, monkeypatch, source, flagged):
    planted = tmp_path / "parallel" / "data" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PARALLEL", tmp_path / "parallel")
    assert any("planted.py" in v for v in _violations()) == flagged
