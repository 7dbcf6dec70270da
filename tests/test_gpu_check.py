"""scripts/gpu_check.py on CPU at its quick sizes, as CI runs it: every item writes its line, with its keys,
and passes; `--device cuda` without a GPU stops in one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
KEYS = {
    "kernel": {"shape_bshkd", "cases"},
    "train_dense": {"losses", "gap_vs_cpu", "deterministic_rerun_bitwise_equal"},
    "train_moe": {"losses", "gap_vs_cpu", "deterministic_rerun_bitwise_equal"},
    "memory": {"accounted_bytes", "by_category", "coexisting_floor_bytes", "allocator_peak", "ratio"},
    "throughput": {"tokens_per_s", "mfu", "peak_flops", "plain_tokens_per_s", "ratio"},
}


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_runs_every_item_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.jsonl"
    assert _script().main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["item"] for line in lines] == list(KEYS)
    for line in lines:
        assert line["pass"] is True and line["device"] == "cpu" and line["seconds"] >= 0, line
        assert KEYS[line["item"]] <= set(line), (line["item"], KEYS[line["item"]] - set(line))
    kernel = lines[0]
    assert {(c["dtype"], c["causal"]) for c in kernel["cases"]} == {
        ("bfloat16", True), ("bfloat16", False), ("float32", True), ("float32", False)}
    assert all(c["max_gap"] > 0 for c in kernel["cases"])  # a fused kernel ran, not the reference itself
    for item in lines[1:3]:
        assert item["deterministic_rerun_bitwise_equal"] and len(item["losses"]) == 3
    memory = lines[3]
    assert set(memory["by_category"]) == {"params", "grads", "main_params", "optimizer", "activations_peak"}
    assert all(memory["by_category"][k] > 0 for k in ("params", "grads", "optimizer", "activations_peak"))
    assert memory["accounted_bytes"] == sum(memory["by_category"].values())
    cat = memory["by_category"]
    assert memory["coexisting_floor_bytes"] == cat["params"] + cat["main_params"] + cat["optimizer"] \
        + max(cat["grads"], cat["activations_peak"])
    assert lines[4]["tokens_per_s"] > 0 and lines[4]["plain_tokens_per_s"] > 0 and lines[4]["mfu"] > 0


def test_a_failing_item_writes_its_error_and_the_rest_still_run(tmp_path: Path, monkeypatch) -> None:
    module = _script()

    def broken(device: torch.device, quick: bool) -> dict:
        raise RuntimeError("planted")

    monkeypatch.setitem(module.ITEMS, "kernel", broken)
    monkeypatch.setitem(module.ITEMS, "memory", lambda device, quick: {"pass": True, "accounted_bytes": 1})
    out = tmp_path / "check.jsonl"
    assert module.run_items(torch.device("cpu"), True, out, ["kernel", "memory"]) is False
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["pass"] is False and lines[0]["error"] == "RuntimeError: planted"
    assert lines[1] == {"item": "memory", "device": "cpu", "pass": True, "accounted_bytes": 1,
                        "seconds": lines[1]["seconds"]}


def test_cuda_without_a_gpu_stops_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _script().main(["--device", "cuda", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("tolerance", [2e-2, 1e-4])
def test_the_kernel_gap_is_relative_to_the_reference(tolerance: float) -> None:
    module = _script()
    ref = torch.tensor([2.0, -4.0], dtype=torch.float64)
    assert module._gap(ref + torch.tensor([0.0, 4 * tolerance], dtype=torch.float64), ref) == pytest.approx(tolerance)
