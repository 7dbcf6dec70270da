"""Process-wide state only where it must be: every piece is listed in docs/runtime.md, and nothing else exists.

The scan reads every module of src/orangetron and finds state that lives in the process and changes at run
time: names a `global` statement rebinds, `globals()[...]` writes, module-level containers (dict, list, set,
deque, ...) that some code of the module changes, `functools.lru_cache` memo tables, whose arguments must be
immutable descriptions so that a cached answer can never go stale, and signal handlers (`signal.signal` calls),
which hold for the whole process until they are put back. The set found must equal the table in
docs/runtime.md's "Process-wide state" section, so a new piece fails here until it is documented (or removed).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "orangetron"
DOC = ROOT / "docs" / "runtime.md"
CONTAINERS = {"dict", "list", "set", "deque", "defaultdict", "OrderedDict", "Counter", "WeakKeyDictionary",
              "WeakValueDictionary", "WeakSet", "bytearray"}
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "popitem", "clear",
            "update", "setdefault", "add", "discard", "remove", "sort", "reverse", "__setitem__", "__delitem__"}
# What an lru_cache'd function may take: immutable values, and frozen dataclasses (found by the scan).
IMMUTABLE = {"int", "float", "str", "bool", "None", "tuple", "torch", "device", "dtype"}  # torch.device, torch.dtype


def _is_container(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in CONTAINERS
    return False


def _module_containers(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_container(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                and _is_container(node.value):
            names.add(node.target.id)
    return names


def _changed_names(tree: ast.Module) -> set[str]:
    """Names whose object some code changes in place: `x[k] = v`, `del x[k]`, `x.append(...)`, `x.pop` ..."""
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Name):
                changed.add(node.value.id)
        elif isinstance(node, ast.Attribute) and node.attr in MUTATORS and isinstance(node.value, ast.Name):
            changed.add(node.value.id)
    return changed


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return {"<unannotated>"}
    text = ast.unparse(annotation)
    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text)) - {"Ellipsis"}


def _lru_cached(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        "lru_cache" in ast.unparse(d) or ast.unparse(d) in ("cache", "functools.cache") for d in node.decorator_list)


def _frozen_classes(trees: list[ast.Module]) -> set[str]:
    """Names of `@dataclass(frozen=True)` classes, and of module-level aliases of them (`Degrees = Layout`)."""
    frozen = {node.name for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
              and any("frozen=True" in ast.unparse(d) for d in node.decorator_list)}
    aliases = {node.targets[0].id: node.value.id for tree in trees for node in tree.body
               if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
               and isinstance(node.targets[0], ast.Name)}
    return frozen | {alias for alias, name in aliases.items() if name in frozen}


def _immutable_aliases(trees: list[ast.Module], immutable: set[str]) -> set[str]:
    """`immutable` and the module-level type aliases built of such names only (`Row = tuple[Piece, ...]` where
    `Piece = tuple[int, int]`), to a fixed point."""
    aliases = {node.targets[0].id: _annotation_names(node.value) for tree in trees for node in tree.body
               if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
               and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}
    known = set(immutable)
    while more := {alias for alias, names in aliases.items() if names <= known} - known:
        known |= more
    return known


def _mutable_arguments(node: ast.FunctionDef, immutable: set[str]) -> list[str]:
    args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    return [f"{node.name}({a.arg}: {ast.unparse(a.annotation) if a.annotation else '?'})" for a in args
            if not _annotation_names(a.annotation) <= immutable]


def _installs_signal_handler(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) == "signal.signal"


def scan(src: Path) -> tuple[set[tuple[str, str]], list[str]]:
    """(file, name) of every piece of process-wide state under `src`, and the lru_caches with mutable arguments.

    A memo table is reported as (`<top folder>/*.py`, `@lru_cache`): they are documented by folder; a module
    that installs signal handlers as (file, `signal.signal`)."""
    found, mutable = set(), []
    trees = {path.relative_to(src).as_posix(): ast.parse(path.read_text(), str(path))
             for path in sorted(src.rglob("*.py"))}
    immutable = _immutable_aliases(list(trees.values()), IMMUTABLE | _frozen_classes(list(trees.values())))
    for rel, tree in trees.items():
        found |= {(rel, name) for name in _module_containers(tree) & _changed_names(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found |= {(rel, name) for name in node.names}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and ast.unparse(node.value) == "globals()":
                found.add((rel, "globals()"))
            elif _installs_signal_handler(node):
                found.add((rel, "signal.signal"))
            elif _lru_cached(node):
                found.add((f"{rel.split('/')[0]}/*.py" if "/" in rel else rel, "@lru_cache"))
                mutable += [f"{rel}: {m}" for m in _mutable_arguments(node, immutable)]
    return found, mutable


def documented(doc: Path) -> set[tuple[str, str]]:
    """(file, name) pairs of the table under "## Process-wide state": backquoted files x backquoted names."""
    section = doc.read_text().split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    entries = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        files, names = re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1])
        entries |= {(f, n) for f in files for n in names}
    return entries


def test_process_wide_state_is_exactly_what_docs_runtime_lists():
    found, _ = scan(SRC)
    listed = documented(DOC)
    assert found - listed == set(), "process-wide state missing from docs/runtime.md's table"
    assert listed - found == set(), "docs/runtime.md lists process-wide state that no longer exists"


def test_memo_tables_take_only_immutable_arguments():
    _, mutable = scan(SRC)
    assert mutable == []


@pytest.mark.parametrize("source, expected", [
    ("COUNT = 0\n\ndef bump():\n    global COUNT\n    COUNT += 1\n", {("planted.py", "COUNT")}),
    ("CACHE = {}\n\ndef remember(k, v):\n    CACHE[k] = v\n", {("planted.py", "CACHE")}),
    ("SEEN: list[int] = []\n\ndef see(x):\n    SEEN.append(x)\n", {("planted.py", "SEEN")}),
    ("TABLE = {'a': 1}\n\ndef read(k):\n    return TABLE[k]\n", set()),
    ("from functools import lru_cache\n\n@lru_cache\ndef f(n: int) -> int:\n    return n\n",
     {("planted.py", "@lru_cache")}),
    ("import signal\n\ndef quiet():\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n",
     {("planted.py", "signal.signal")}),
])
def test_the_scan_sees_planted_state(tmp_path, source, expected):
    (tmp_path / "planted.py").write_text(source)
    assert scan(tmp_path)[0] == expected


def test_the_scan_refuses_a_memo_table_over_a_mutable_argument(tmp_path):
    (tmp_path / "planted.py").write_text(
        "from functools import lru_cache\n\n@lru_cache(maxsize=8)\ndef f(model: nn.Module) -> int:\n    return 1\n")
    assert scan(tmp_path)[1] == ["planted.py: f(model: nn.Module)"]


def test_the_documented_table_is_parsed(tmp_path):
    doc = tmp_path / "runtime.md"
    doc.write_text("# x\n\n## Process-wide state\n\n| file | names |\n|---|---|\n"
                   "| `comm.py` | `_records`, `_dropped` |\n| `spec/*.py`, `plan/*.py` | `@lru_cache` |\n\n## Next\n"
                   "| `other.py` | `_x` |\n")
    assert documented(doc) == {("comm.py", "_records"), ("comm.py", "_dropped"), ("spec/*.py", "@lru_cache"),
                               ("plan/*.py", "@lru_cache")}


if __name__ == "__main__":  # print what the scan finds, to write the table
    for entry in sorted(scan(SRC)[0]):
        print(*entry, file=sys.stdout)
