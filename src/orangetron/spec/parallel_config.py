"""`ParallelConfig`: the parallel options of one configuration, the one type the runtime and the planner share.

The runtime takes it as `ot.ParallelConfig` (re-exported by `orangetron.parallel`); the planner's `Job`
(spec/options.py) and the trainer's `TrainConfig` (train/config.py) are subclasses that add only what they alone
need. It is validated on construction by the rules both sides hold (spec/rules.py). What only the runtime refuses
(variants the planner prices but the runtime does not run, dtypes it has no torch dtype for, gradient buckets
under ZeRO-3) is `orangetron.parallel.config.check_runnable`, which the runtime calls before it builds anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from orangetron.spec import rules
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
DROP_POLICIES = ("probs", "position")


class ParallelConfigError(ValueError):
    """A parallel option that cannot run; the message names the field, the value and the rule."""


def check_capacity_factor(value: float) -> None:
    """A capacity factor is a positive finite multiple of an expert's fair share."""
    if not 0 < value < math.inf:
        raise ParallelConfigError(f"capacity_factor={value!r}: must be positive and finite (from num_experts / "
                                  "top_k up, no token is dropped)")


@dataclass(frozen=True)
class ParallelConfig:
    """Options of every parallel dimension; `train` and `estimate` take them as flags of the same name with dashes.

    `recompute` and `recompute_layers` are run by the runtime (`orangetron/parallel/recompute.py`) as the planner
    prices them; selective recompute keeps what none keeps there (docs/runtime.md, Activation recompute).
    """

    sequence_parallel: bool = False  # TP's all-reduce becomes reduce-scatter + all-gather; norms on shards
    cp_mode: str = "ring"  # context-parallel attention: a name of CONTEXT_MODES (ring, allgather, ulysses, usp, rsa)
    ulysses_degree: int = 1  # for cp_mode="usp": the all-to-all factor of cp (the rest is ring)
    dispatcher: str = "ragged"  # expert dispatch: a name of DISPATCHERS (ragged, capacity, allgather, deepep)
    capacity_factor: float = 1.0  # for dispatcher="capacity": slots per expert = factor * fair share
    drop_policy: str = "probs"  # for dispatcher="capacity": drop the lowest-probability or latest tokens
    ep_overlap_chunks: int = 1  # ragged dispatch in this many token chunks, one chunk's all-to-all overlapping
    # another's expert compute; 1: dispatch, experts and combine one after another
    zero_stage: int = 0  # 0 = DDP, 1 = optimizer state, 2 = + gradients, 3 = + parameters sharded
    distributed_optimizer: bool = False  # ZeRO-1 sharding with the parameter all-gather right after the step
    param_dtype: str = "float32"  # model parameters (fp32 main params and grads are kept when lower)
    reduce_dtype: str | None = None  # gradient reduction dtype; None: param_dtype, as docs/data_parallel.md's tables
    grad_bucket_numel: int = 0  # reduce gradients in buckets of about this many elements during backward (DDP:
    # all-reduce; ZeRO-1/2, distributed optimizer: reduce-scatter, buckets rounded to the shard count); 0: one
    # reduction after backward
    zero3_prefetch: bool = True  # ZeRO-3: start gathering the next unit while the current one computes
    zero3_keep_params: bool = False  # ZeRO-3: keep the forward's gathered units until their backward (no
    # second gather, more memory: Llama 3's choice)
    zero3_reduce_every_microbatch: bool = False  # ZeRO-3: reduce-scatter each micro-batch's gradients into the
    # sharded main buffer (as DeepSpeed and FSDP2 by default); off: inside no_sync they wait, whole, in .grad
    pp_schedule: str = "1f1b"  # a name of SCHEDULES: gpipe, 1f1b, interleaved (zb-h1: planner only)
    microbatches: int = 1  # micro-batches per step (the planner's `Job` derives them from global_batch when set)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    recompute: str = "none"  # none, selective (attention core), full (whole layer)
    # Under full recompute, how many layers of each pipeline chunk replay their forward, counted from the chunk's
    # first (Megatron's block method, --recompute-num-layers); 0: every layer
    recompute_layers: int = 0

    def __post_init__(self) -> None:
        mode = CONTEXT_MODES[self.cp_mode]  # known names first: the rules below ask their records
        dispatcher, schedule = DISPATCHERS[self.dispatcher], SCHEDULES[self.pp_schedule]
        self._check_choices()
        self._check_numbers()
        rules.distributed_optimizer_zero_stage(self.distributed_optimizer, self.zero_stage)
        rules.zero3_reduce_every_microbatch_needs_zero3(self.zero3_reduce_every_microbatch, self.zero_stage)
        rules.recompute_layers_need_full(self.recompute_layers, self.recompute)
        rules.ulysses_degree_only_for_its_modes(self.ulysses_degree, self.cp_mode, mode.takes_ulysses_degree)
        rules.overlap_chunks_need_chunked_dispatcher(self.ep_overlap_chunks, self.dispatcher, dispatcher.chunked)
        rules.virtual_stages_need_chunked_schedule(self.virtual_stages, self.pp_schedule, schedule.chunks)

    def _check_choices(self) -> None:
        check_choice("drop_policy", self.drop_policy, DROP_POLICIES)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("param_dtype", self.param_dtype, tuple(DTYPE_BYTES))
        if self.reduce_dtype is not None:
            check_choice("reduce_dtype", self.reduce_dtype, tuple(DTYPE_BYTES))

    def _check_numbers(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ParallelConfigError(f"zero_stage={self.zero_stage!r}: must be 0 (DDP), 1, 2 or 3")
        for name in ("ulysses_degree", "microbatches", "virtual_stages", "ep_overlap_chunks"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("grad_bucket_numel", "recompute_layers"):
            check_int(name, getattr(self, name), minimum=0)
        check_capacity_factor(self.capacity_factor)

    @property
    def shards_optimizer(self) -> bool:
        return self.zero_stage >= 1 or self.distributed_optimizer

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def mixed_precision(self) -> bool:
        """fp32 main params and main grads exist only when the model params are in a lower precision."""
        return DTYPE_BYTES[self.param_dtype] < 4

    @property
    def wire_dtype(self) -> str:
        """The gradient reduction's dtype: `reduce_dtype`, else the parameters' (docs/data_parallel.md)."""
        return self.reduce_dtype or self.param_dtype


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ParallelConfigError(f"{name}={value!r}: must be one of {', '.join(choices)}")


def check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ParallelConfigError(f"{name}={value!r}: must be {rule}")


def values_of(cls: type, obj: object) -> dict[str, Any]:
    """`obj`'s values of the fields of dataclass `cls`: what `cls` holds of an object that embeds it (a subclass,
    as `TrainConfig` embeds `ParallelConfig` and `Layout`), by field name. `cls(**values_of(cls, obj))` is that
    part of `obj` on its own."""
    return {f.name: getattr(obj, f.name) for f in fields(cls)}
