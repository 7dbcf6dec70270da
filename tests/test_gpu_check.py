"""scripts/gpu_check.py on CPU at its quick sizes, as CI runs it: every item writes its line, with its keys,
and passes (the context-parallel replay of every mode within tolerance, the host syncs within budget);
`--device cuda` without a GPU stops in one line."""

from __future__ import annotations

import importlib
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
KEYS = {
    "kernel": {"shape_bshkd", "cases"},
    "train_dense": {"losses", "gap_vs_cpu", "deterministic_rerun_bitwise_equal"},
    "train_moe": {"losses", "gap_vs_cpu", "deterministic_rerun_bitwise_equal"},
    "memory": {"accounted_bytes", "by_category", "coexisting_floor_bytes", "allocator_peak", "ratio"},
    "packed": {"shape_bshkd", "documents", "path", "gaps"},
    "cp_replay": {"cp", "ulysses_degree", "shape_bshkd", "modes", "max_rel_error"},
    "host_syncs": {"dispatches", "budget", "counted", "by_region", "per_dispatch", "cuda_sync_debug"},
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
    by_item = {line["item"]: line for line in lines}
    for line in lines:
        assert line["pass"] is True and line["device"] == "cpu" and line["seconds"] >= 0, line
        assert KEYS[line["item"]] <= set(line), (line["item"], KEYS[line["item"]] - set(line))
    kernel = lines[0]
    assert {(c["dtype"], c["causal"]) for c in kernel["cases"]} == {
        ("bfloat16", True), ("bfloat16", False), ("float32", True), ("float32", False)}
    assert all(c["max_gap"] > 0 for c in kernel["cases"])  # a fused kernel ran, not the reference itself
    for item in lines[1:3]:
        assert item["deterministic_rerun_bitwise_equal"] and len(item["losses"]) == 3
    memory = by_item["memory"]
    assert set(memory["by_category"]) == {"params", "grads", "main_params", "optimizer", "activations_peak"}
    assert all(memory["by_category"][k] > 0 for k in ("params", "grads", "optimizer", "activations_peak"))
    assert memory["accounted_bytes"] == sum(memory["by_category"].values())
    cat = memory["by_category"]
    assert memory["coexisting_floor_bytes"] == cat["params"] + cat["main_params"] + cat["optimizer"] \
        + max(cat["grads"], cat["activations_peak"])
    speed = by_item["throughput"]
    assert speed["tokens_per_s"] > 0 and speed["plain_tokens_per_s"] > 0 and speed["mfu"] > 0
    packed = by_item["packed"]
    # bf16 against float64 under the dense block-diagonal mask: visibly rounded (it ran in bf16), within 2e-2.
    assert packed["path"] == "per-document calls" and set(packed["gaps"]) == {"out", "dq", "dk", "dv"}
    assert all(1e-4 < gap <= 2e-2 for gap in packed["gaps"].values()), packed
    _check_cp_replay(by_item["cp_replay"])
    syncs = by_item["host_syncs"]
    # Two MoE layers: one read per dispatch (the experts' group sizes), none in either attention block.
    assert syncs["dispatches"] == syncs["budget"] == 2 and 0 < syncs["counted"] <= syncs["budget"], syncs
    assert syncs["by_region"]["attention"] == 0 and syncs["per_dispatch"] <= 1, syncs
    assert syncs["cuda_sync_debug"].startswith("skipped"), syncs


def _check_cp_replay(line: dict) -> None:
    """Every mode, in both dtypes: a low-precision result within the kernel tolerance (bf16 visibly rounded, so
    it really ran in bf16; float32 far closer); the per-mode error is the larger of the two."""
    assert set(line["modes"]) == {"ring", "allgather", "ulysses", "usp", "rsa"}
    for mode, cases in line["modes"].items():
        assert set(cases) == {"bfloat16", "float32"}, mode
        assert 0 < cases["float32"]["max_gap"] < 1e-5 and 1e-4 < cases["bfloat16"]["max_gap"] <= 2e-2, (mode, cases)
        assert set(cases["float32"]["gaps"]) == {"out", "dq", "dk", "dv"}, mode
        assert line["max_rel_error"][mode] == max(c["max_gap"] for c in cases.values()), mode


@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses", "usp", "rsa"])
def test_each_cp_replay_rank_sees_every_key_once_and_the_ranks_split_the_queries(mode: str) -> None:
    """The replayed block sequence covers the work of one device exactly: the emulated ranks' (position, query
    head) pairs are each held once, and each rank's key blocks hold every position once, on the kv heads of its
    query heads."""
    module = _script()
    seq, hq, hk = 32, 8, 2
    held = []
    for m in module.cp_members(mode, seq, hq, hk):
        positions = [p for a, b in m.q_runs for p in range(a, b)]
        held += [(p, h) for p in positions for h in range(*m.heads)]
        keys = sorted(p for runs in m.blocks for a, b in runs for p in range(a, b))
        assert keys == list(range(seq)), (mode, m)
        group = hq // hk  # query heads per kv head
        assert {h // group for h in range(*m.heads)} == set(range(*m.kv_heads)), (mode, m)
    assert sorted(held) == [(p, h) for p in range(seq) for h in range(hq)], mode


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


def test_a_step_over_the_sync_budget_fails(monkeypatch) -> None:
    """One more read per dispatch (the experts reading their group sizes twice) puts the step over budget."""
    module = _script()
    moe = importlib.import_module("orangetron.model.moe")
    forward = moe.LocalDispatcher.forward

    def reads_again(self, x, *args, **kwargs):
        x.sum().item()
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(moe.LocalDispatcher, "forward", reads_again)
    line = module.item_host_syncs(torch.device("cpu"), True)
    assert line["counted"] == 2 * line["dispatches"] == 4 and line["pass"] is False, line


def test_the_cuda_sync_debug_mode_is_set_for_the_block_and_restored(monkeypatch) -> None:
    """Stood in for on CPU: the mode is "warn" inside the block, the previous one after, and the block's
    warnings are handed back (one per sync)."""
    module = _script()
    modes = ["default"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with module.cuda_sync_warnings(torch.device("cuda", 0)) as caught:
        assert modes[-1] == "warn"
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert modes == ["default", "warn", "default"]
    assert module.sync_warnings(caught) == 1
    with module.cuda_sync_warnings(torch.device("cpu")) as none:
        assert none is None and modes[-1] == "default"
