"""MFU against a GPU's datasheet peak, CUDA-event step times and the allocator's peak, on CPU: the name ->
preset matching, and every reporting path with torch.cuda's answers stood in."""

from __future__ import annotations

import io

import pytest
import torch

from orangetron.train import mfu, trainer
from orangetron.train.commands import _summary
from orangetron.train.config import TrainConfig

# torch.cuda.get_device_name strings as drivers report them -> preset (None: no preset has that board's peak).
NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H800", "h800"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA A800-SXM4-80GB", "a800"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GB200", "gb200"),
    ("NVIDIA GB300", "gb300"),
    ("NVIDIA B300", None),
    ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA GeForce RTX 3090 Ti", None),
    ("AMD Instinct MI300X", "mi300x"),
    ("Tesla V100-SXM2-16GB", None),
]


@pytest.mark.parametrize(("device_name", "preset"), NAMES)
def test_a_device_name_matches_its_preset_or_none(device_name: str, preset: str | None) -> None:
    found = mfu.gpu_preset_for(device_name)
    assert (found.name if found else None) == preset


def _gpu_named(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_the_peak_on_cuda_is_the_presets_datasheet_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu_named(monkeypatch, "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert mfu.device_peak_flops(torch.bfloat16, cuda) == (pytest.approx(989.4e12), "datasheet h100")
    assert mfu.device_peak_flops(torch.float32, cuda) == (pytest.approx(66.9e12), "datasheet h100")
    _gpu_named(monkeypatch, "Tesla V100-SXM2-16GB")
    peak, why = mfu.device_peak_flops(torch.bfloat16, cuda)
    assert peak is None and "'Tesla V100-SXM2-16GB' matches no preset" in why


def test_the_peak_on_cpu_is_measured() -> None:
    peak, source = mfu.device_peak_flops(torch.float64, torch.device("cpu"))
    assert source == "measured matmul" and peak > 0


class _FakeEvent:
    """torch.cuda.Event as the timer uses it, on a clock the test sets."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at - self.at  # milliseconds, as torch's


def test_the_step_timer_reads_cuda_events_on_a_gpu_and_the_host_clock_elsewhere(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    timer = mfu.StepTimer(torch.device("cuda", 0))
    _FakeEvent.clock = 1000.0
    timer.start()
    _FakeEvent.clock = 3500.0  # 2500 ms later on the device
    assert timer.stop() == pytest.approx(2.5)
    clock = iter([10.0, 12.25])
    monkeypatch.setattr(mfu.time, "perf_counter", lambda: next(clock))
    host = mfu.StepTimer(torch.device("cpu"))
    host.start()
    assert host.stop() == pytest.approx(2.25)


def test_the_allocator_peak_is_reported_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123_456)
    assert mfu.allocator_peak(torch.device("cuda", 0)) == {"allocator_peak": 123_456}
    assert mfu.allocator_peak(torch.device("cpu")) == {}


def test_a_run_on_an_unknown_gpu_reports_no_mfu_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "GPU 'Mystery 9000' matches no preset in spec/presets/gpus: no datasheet peak, so no MFU"
    monkeypatch.setattr(trainer, "device_peak_flops", lambda dtype, device: (None, why))
    cfg = TrainConfig(model="tiny", steps=3, seq_len=16, batch_size=2, warmup=0, corpus_bytes=20_000)
    result = trainer.train(cfg, progress=False)
    assert result["mfu"] is None and result["peak_flops"] is None and why in result["warnings"]
    assert result["tokens_per_s"] > 0
    out = io.StringIO()
    _summary(result, out)
    assert "MFU " not in out.getvalue().replace(why, "") and why in out.getvalue()


def test_a_cpu_run_reports_mfu_against_its_measured_peak() -> None:
    cfg = TrainConfig(model="tiny", steps=3, seq_len=16, batch_size=2, warmup=0, corpus_bytes=20_000)
    result = trainer.train(cfg, progress=False)
    assert result["peak_source"] == "measured matmul" and result["mfu"] > 0
    assert "allocator_peak" not in result["memory"][0]
    out = io.StringIO()
    _summary(result, out)
    assert "(measured matmul)" in out.getvalue()
