"""GPU presets (TOML in `presets/gpus`, each citing its public datasheet) and the cluster they form."""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from importlib import resources
from pathlib import Path

from orangetron.spec.keys import hash_fields_once
from orangetron.spec.toml_values import check_scalar

_PRESET_DIR = "presets/gpus"
GIB = 1024**3
# GEMM operand formats on the FP8 tensor cores: per-tensor scales (Transformer Engine's delayed scaling), and
# DeepSeek-V3's 1 x 128 / 128 x 128 blocks, whose scales Hopper applies on the CUDA cores every 128 elements.
FP8_FORMATS = ("float8", "float8-blockwise")


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator and the node it sits in. Bandwidths are per direction, in GB/s (10^9 B/s)."""

    name: str
    sms: int
    bf16_tflops: float  # dense tensor-core peak
    fp32_tflops: float  # non-tensor FP32 peak
    memory_gib: float  # device total as nvidia-smi (rocm-smi) reports it, in GiB
    memory_bw_gbs: float
    intra_node: str  # "nvswitch" | "nvlink" | "pcie"
    intra_bw_gbs: float
    nvls: bool  # NVSwitch in-switch reduction (NVLink SHARP) available
    gpus_per_node: int
    nic_gbps: float  # inter-node NIC line rate per GPU, Gbit/s
    gemm_efficiency: float  # share of dense peak reached by large, well-shaped GEMMs (shape losses apart)
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 tensor cores
    attention_fwd_efficiency: float = 0.0  # the fused attention kernel's share of peak at long sequences, fwd
    attention_bwd_efficiency: float = 0.0  # and bwd; 0: the global defaults of `timing.Efficiency`
    flash2_fwd_efficiency: float = 0.0  # FlashAttention-2's share where it differs from the best kernel's
    flash2_bwd_efficiency: float = 0.0  # (Hopper); 0: the same as attention_*_efficiency
    fp8_blockwise_gemm_efficiency: float = 0.0  # gemm_efficiency of blockwise-scaled FP8; 0: gemm_efficiency

    def __post_init__(self) -> None:
        check_gpu_fields(self)

    def attention_efficiency(self, kernel: str) -> tuple[float, float]:
        """(forward, backward) long-sequence share of peak of the fused attention `kernel` on this GPU (0: use
        the global default)."""
        if kernel == "flash2" and self.flash2_fwd_efficiency:
            return self.flash2_fwd_efficiency, self.flash2_bwd_efficiency
        return self.attention_fwd_efficiency, self.attention_bwd_efficiency

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Dense peak in FLOP/s for matmuls in `dtype` (float32 runs on the FP32 cores; TF32 is not assumed;
        the FP8 formats run at the FP8 tensor-core peak)."""
        if dtype in FP8_FORMATS:
            if not self.fp8_tflops:
                raise ValueError(f"fp8: gpu {self.name} has no FP8 tensor cores (fp8_tflops = 0)")
            return self.fp8_tflops * 1e12
        return (self.fp32_tflops if dtype in ("float32", "float64") else self.bf16_tflops) * 1e12

    def matmul_efficiency(self, dtype: str) -> float:
        """Share of `dtype`'s peak a large, well-shaped GEMM sustains (shape losses apart)."""
        if dtype == "float8-blockwise" and self.fp8_blockwise_gemm_efficiency:
            return self.fp8_blockwise_gemm_efficiency
        return self.gemm_efficiency

    def without_sms(self, reserved: int) -> GPUSpec:
        """This GPU as compute sees it when `reserved` SMs are set aside for communication: fewer SMs, and each
        tensor and FP32 peak scaled by the SMs left. HBM bandwidth stays: memory-bound kernels saturate it with
        fewer SMs than a GPU has (an assumption, not a measurement)."""
        if not 0 <= reserved < self.sms:
            raise ValueError(f"{reserved} reserved SMs: the {self.name} has {self.sms}")
        left = (self.sms - reserved) / self.sms
        return replace(self, sms=self.sms - reserved, bf16_tflops=self.bf16_tflops * left,
                       fp32_tflops=self.fp32_tflops * left, fp8_tflops=self.fp8_tflops * left)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


INTRA_NODE_LINKS = ("nvswitch", "nvlink", "pcie")
_POSITIVE_FIELDS = ("bf16_tflops", "fp32_tflops", "memory_gib", "memory_bw_gbs", "intra_bw_gbs", "nic_gbps")
_SHARE_FIELDS = ("attention_fwd_efficiency", "attention_bwd_efficiency", "flash2_fwd_efficiency",
                 "flash2_bwd_efficiency", "fp8_blockwise_gemm_efficiency")  # 0: the default the field names


def check_gpu_fields(gpu: GPUSpec) -> None:
    """Refuse a field of the wrong kind or out of range, naming it: a GPU file's zero divided the step time, a
    negative bandwidth made it negative, an efficiency typed as a percent put MFU past 100%, and a quoted
    `"false"` read as true."""
    check_scalar(f"name={gpu.name!r}", gpu.name, str)
    check_scalar(f"nvls={gpu.nvls!r}", gpu.nvls, bool)
    check_scalar(f"intra_node={gpu.intra_node!r}", gpu.intra_node, str)
    if gpu.intra_node not in INTRA_NODE_LINKS:
        raise ValueError(f"intra_node={gpu.intra_node!r}: must be one of {', '.join(INTRA_NODE_LINKS)}")
    for name in ("sms", "gpus_per_node"):
        value = getattr(gpu, name)
        check_scalar(f"{name}={value!r}", value, int)
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    for name in (*_POSITIVE_FIELDS, "gemm_efficiency", "fp8_tflops", *_SHARE_FIELDS):
        value = getattr(gpu, name)
        check_scalar(f"{name}={value!r}", value, float)
        zero_allowed = name == "fp8_tflops" or name in _SHARE_FIELDS
        if not math.isfinite(value) or value < 0 or value == 0 and not zero_allowed:
            raise ValueError(f"{name}={value}: must be a finite number {'>= 0' if zero_allowed else '> 0'}")
        if value > 1 and (name == "gemm_efficiency" or name in _SHARE_FIELDS):
            raise ValueError(f"{name}={value}: a share of peak, at most 1 (0.7, not 70)")


@dataclass(frozen=True)
class Cluster:
    """`num_gpus` GPUs in nodes of `gpus_per_node`, NICs of `nic_gbps` each, and a transport for GPU traffic."""

    gpu: GPUSpec
    num_gpus: int
    gpus_per_node: int
    nic_gbps: float
    transport: str = "proxy"  # "proxy" (CPU proxy thread) | "ibgda" (GPU-initiated)

    __hash__ = hash_fields_once  # keys the cost caches: hashed once

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus={self.num_gpus}, gpus_per_node={self.gpus_per_node}: both must be >= 1")
        if self.transport not in ("proxy", "ibgda"):
            raise ValueError(f"transport={self.transport!r} must be 'proxy' or 'ibgda'")

    @property
    def nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)  # a sub-cluster (DistMM) may end in a partial node

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9 / 8


def gpu_names() -> list[str]:
    root = resources.files("orangetron.spec").joinpath(_PRESET_DIR)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_gpu(name_or_path: str) -> GPUSpec:
    """A GPU preset name (`h100`) or a TOML file with the `GPUSpec` fields."""
    if name_or_path.endswith(".toml"):
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"gpu file {name_or_path} does not exist")
        text = path.read_text()
    else:
        key = name_or_path.lower()
        if key not in gpu_names():
            raise ValueError(f"unknown gpu preset {name_or_path!r}; choose one of {', '.join(gpu_names())}")
        text = resources.files("orangetron.spec").joinpath(_PRESET_DIR, f"{key}.toml").read_text()
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"gpu {name_or_path}: {err}") from None
    names = {f.name for f in fields(GPUSpec)}
    required = {f.name for f in fields(GPUSpec) if f.default is MISSING}
    unknown = sorted(set(table) - names)
    if unknown:
        hints = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, names, 1, 0.6))
                 else key for key in unknown]
        raise ValueError(f"gpu {name_or_path}: unknown key(s) {', '.join(hints)}")
    missing = sorted(required - set(table))
    if missing:
        raise ValueError(f"gpu {name_or_path}: missing key(s) {', '.join(missing)}")
    try:
        return GPUSpec(**{k: table[k] for k in names if k in table})
    except ValueError as err:
        raise ValueError(f"gpu {name_or_path}: {err}") from None


def make_cluster(gpu: str | GPUSpec, num_gpus: int, gpus_per_node: int | None = None,
                 nic_gbps: float | None = None, transport: str = "proxy") -> Cluster:
    """A cluster of `num_gpus` preset GPUs; node size and NIC default to the preset's."""
    spec = load_gpu(gpu) if isinstance(gpu, str) else gpu
    per_node = gpus_per_node or spec.gpus_per_node
    if num_gpus > per_node and num_gpus % per_node:
        raise ValueError(f"gpus={num_gpus} is not a multiple of gpus_per_node={per_node}")
    return Cluster(spec, num_gpus, min(per_node, num_gpus), nic_gbps or spec.nic_gbps, transport)
