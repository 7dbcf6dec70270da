"""Memory a training process holds beyond its tensors: a fixed part and a part proportional to what it allocates.

The categories of `memory.py` count tensor bytes exactly (the runtime's ledger equals them), but a GPU also
holds memory no tensor owns:

- fixed: the CUDA context with the kernels of PyTorch, cuBLAS and NCCL loaded (about 0.5-1 GiB on H100 with
  lazy module loading, as `nvidia-smi` shows for a process that has only initialized CUDA), the cuBLAS
  workspace (32 MiB per stream on Hopper) and each NCCL communicator's buffers (NCCL_BUFFSIZE = 4 MiB per
  channel and peer for the Simple protocol, plus the LL and LL128 buffers, over up to 32 channels; NVLS
  adds its multicast buffers): we count `context_gib` once and `per_group_gib` per mesh group of more
  than one rank, since every such group is its own communicator;
- proportional: the caching allocator's reserved-but-unused blocks (fragmentation), which grow with the
  memory that is allocated and freed every step: activations and the transient buffers (ZeRO-3's gathered
  layers, the gradient reduction's wire buffers and results). Model states
  live in long-lived buffers and fragment little, so they are left out of the base.

The fixed part is set from those public sizes. The fraction is fitted on published peaks of reserved memory
(the calibration `[[reserved]]` rows of `validation_runs.toml`, table `fitted_overhead`; `plan/reserved.py`
holds the fit, `scripts/refit_planner.py` reproduces it): those rows do not separate a fixed GiB from a share,
so only one of the two is fitted.

What a layout needs is less than what it reserves where memory is plentiful: when a request finds no free
block and the device has no room left, the caching allocator releases its unused cached blocks and retries
before it fails, so only the fragmentation inside segments still in use stays. The fit check therefore
counts the fixed part and a smaller `pressured_fraction` of the same base (`needed` in the breakdown); the
reported `total` keeps the fraction, the peak such a run reserves with room to spare. The pressured fraction
is bounded by the same calibration rows: a run's published reserved peak is never below what it needed, so
it is the largest value at which no row's need exceeds its published peak (`"pressured fraction"`).

`--overhead-gib` and `--overhead-fraction` replace the fixed part and the fraction (both 0 turn the term off;
the fit check counts the smaller of the two fractions).
"""

from __future__ import annotations

from dataclasses import dataclass

from orangetron.spec.hardware import GIB
from orangetron.spec.options import Degrees


class OverheadError(ValueError):
    """A memory-overhead setting outside its range."""


@dataclass(frozen=True)
class MemoryOverhead:
    """Fixed GiB (context, plus per communicator) and a fraction of the step's dynamic allocations."""

    context_gib: float = 1.0  # CUDA context, library kernels, cuBLAS workspace
    per_group_gib: float = 0.5  # one NCCL communicator's buffers
    # allocator fragmentation, share of activations and transient buffers; fitted on calibration rows:
    # plan/validation_runs.toml, "overhead fraction"
    fraction: float = 0.19
    # the share that stays when the allocator, short of memory, has released its unused cache: what the fit
    # check counts; bounded on calibration rows: plan/validation_runs.toml, "pressured fraction"
    pressured_fraction: float = 0.02

    def __post_init__(self) -> None:
        for name in ("context_gib", "per_group_gib", "fraction", "pressured_fraction"):
            if getattr(self, name) < 0:
                raise OverheadError(f"{name}={getattr(self, name)}: must be >= 0")
        for name in ("fraction", "pressured_fraction"):
            if getattr(self, name) >= 1:
                raise OverheadError(f"{name}={getattr(self, name)}: must be < 1 (a share of the dynamic allocations)")

    def fixed_bytes(self, deg: Degrees) -> int:
        groups = sum(size > 1 for size in (deg.tp, deg.cp, deg.pp, deg.dp_cp, deg.ep, deg.edp))
        groups += deg.expert_fold and 1 < deg.etp != deg.tp  # a folded etp group of its own
        return int((self.context_gib + self.per_group_gib * groups) * GIB)

    def bytes(self, memory: dict[str, int], deg: Degrees) -> int:
        """Overhead bytes for a per-GPU breakdown from `memory.memory_per_gpu`, as reserved with room to spare."""
        return self.fixed_bytes(deg) + int(self.fraction * _dynamic(memory))

    def needed_bytes(self, memory: dict[str, int], deg: Degrees) -> int:
        """Overhead bytes the layout needs: what stays when the allocator has released its unused cache (never
        more than `bytes`, so a fraction of 0 turns both off)."""
        return self.fixed_bytes(deg) + int(min(self.pressured_fraction, self.fraction) * _dynamic(memory))


def _dynamic(memory: dict[str, int]) -> int:
    """The base of the proportional part: activations and transient buffers."""
    return memory.get("activations", 0) + memory.get("buffers", 0)


NO_OVERHEAD = MemoryOverhead(0.0, 0.0, 0.0)
DEFAULT_OVERHEAD = MemoryOverhead()


def fixed_overhead(gib: float, fraction: float) -> MemoryOverhead:
    """The `--overhead-gib` / `--overhead-fraction` setting: `gib` in all, whatever the layout."""
    return MemoryOverhead(context_gib=gib, per_group_gib=0.0, fraction=fraction)


def with_overhead(memory: dict[str, int], deg: Degrees, overhead: MemoryOverhead) -> dict[str, int]:
    """`memory` plus an `overhead` entry, counted in `total`, and `needed`: the tensors and the overhead the
    layout cannot do without, which the fit check compares with the GPU's memory."""
    extra = overhead.bytes(memory, deg)
    return {**memory, "overhead": extra, "total": memory["total"] + extra,
            "needed": memory["total"] + overhead.needed_bytes(memory, deg)}


def needed_overhead(memory: dict[str, int]) -> int:
    """The overhead a breakdown from `with_overhead` counts in its `needed` bytes."""
    return memory["needed"] - (memory["total"] - memory["overhead"])


def fits(memory: dict[str, int], limit: float) -> bool:
    """Whether a breakdown from `with_overhead` fits in `limit` bytes: its `needed` bytes do."""
    return memory["needed"] <= limit
