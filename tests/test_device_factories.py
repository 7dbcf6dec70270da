"""Every tensor a collective may touch is made on a device that was chosen, not on the host by default.

The scan reads the source of `orangetron/parallel/` and `orangetron/train/step.py` and fails, with file:line,
on a tensor factory called without `device=`: on CUDA such a tensor lands on the host and NCCL refuses it (or
the op mixes devices). Host bookkeeping goes through `comm.host_tensor`, the one named door to the gloo half.
The `*_like` factories take their input's device and are not factories in this sense.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from orangetron import comm

SRC = Path(__file__).resolve().parents[1] / "src" / "orangetron"
SCANNED = [*sorted((SRC / "parallel").rglob("*.py")), SRC / "train" / "step.py"]
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye",
             "linspace", "empty_strided"}
# (file relative to src/orangetron, factory): why it is host-only. Each entry proven, none for convenience.
HOST_ONLY: dict[tuple[str, str], str] = {}


def _factory(call: ast.Call) -> str | None:
    """`torch.<factory>` called as such (not a method of a tensor)."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch" \
            and func.attr in FACTORIES:
        return func.attr
    return None


def unplaced_factories(path: Path) -> list[str]:
    """'file:line torch.name(...)' for each factory in `path` without a device keyword."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = str(path.relative_to(SRC))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := _factory(node)) is None:
            continue
        if any(k.arg == "device" for k in node.keywords) or (rel, name) in HOST_ONLY:
            continue
        found.append(f"src/orangetron/{rel}:{node.lineno} torch.{name}(...) without device=")
    return found


def test_every_tensor_factory_names_its_device() -> None:
    found = [line for path in SCANNED for line in unplaced_factories(path)]
    assert not found, "tensor factories without device= (use the inputs' or the mesh's device, or " \
                      "comm.host_tensor for host bookkeeping):\n" + "\n".join(found)


def test_the_scan_catches_a_factory_without_a_device(tmp_path: Path) -> None:
    planted = SRC / "parallel" / "_planted_for_scan.py"
    planted.write_text("import torch\n\nx = torch.zeros(3)\ny = torch.zeros(3, device=x.device)\n"
                       "z = torch.tensor([1]).to('cpu')\nw = torch.zeros_like(x)\n")
    try:
        found = unplaced_factories(planted)
    finally:
        planted.unlink()
    assert found == ["src/orangetron/parallel/_planted_for_scan.py:3 torch.zeros(...) without device=",
                     "src/orangetron/parallel/_planted_for_scan.py:5 torch.tensor(...) without device="]


def test_host_tensors_are_made_on_the_host_whatever_the_model_uses() -> None:
    t = comm.host_tensor([1.5, 2.0], dtype=torch.float64)
    assert t.device == torch.device("cpu") and t.dtype == torch.float64 and t.tolist() == [1.5, 2.0]
