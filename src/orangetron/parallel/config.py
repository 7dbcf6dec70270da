"""`ParallelConfig`: how a layout is applied to a model. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orangetron.spec import rules
from orangetron.spec.options import RECOMPUTE
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
DROP_POLICIES = ("probs", "position")


class ParallelConfigError(ValueError):
    """A parallel option that cannot run; the message names the field, the value and the rule."""


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ParallelConfigError(f"{name}={value!r}: must be one of {', '.join(choices)}")


@dataclass(frozen=True)
class ParallelConfig:
    """Options of every parallel dimension; `train` takes most of them as flags of the same name with dashes.
    `recompute` is priced by the planner only: the runtime refuses it (`ParallelModel`)."""

    sequence_parallel: bool = False  # TP's all-reduce becomes reduce-scatter + all-gather; norms on shards
    cp_mode: str = "ring"  # context-parallel attention: ring, allgather, ulysses, usp, rsa
    ulysses_degree: int = 1  # for cp_mode="usp": the all-to-all factor of cp (the rest is ring)
    dispatcher: str = "ragged"  # expert dispatch: ragged (dropless), capacity, allgather
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
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved
    microbatches: int = 1  # micro-batches per step
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    recompute: str = "none"  # none, selective (attention core), full (whole layer)

    def __post_init__(self) -> None:
        mode = CONTEXT_MODES.runtime_record(self.cp_mode)
        dispatcher = DISPATCHERS.runtime_record(self.dispatcher)
        _choice("drop_policy", self.drop_policy, DROP_POLICIES)
        schedule = SCHEDULES.runtime_record(self.pp_schedule)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("param_dtype", self.param_dtype, tuple(DTYPES))
        if self.reduce_dtype is not None:
            _choice("reduce_dtype", self.reduce_dtype, tuple(DTYPES))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ParallelConfigError(f"zero_stage={self.zero_stage!r}: must be 0 (DDP), 1, 2 or 3")
        rules.distributed_optimizer_zero_stage(self.distributed_optimizer, self.zero_stage)
        for name in ("ulysses_degree", "microbatches", "virtual_stages", "ep_overlap_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{name}={value!r}: must be a positive integer")
        if isinstance(self.grad_bucket_numel, bool) or not isinstance(self.grad_bucket_numel, int) \
                or self.grad_bucket_numel < 0:
            raise ParallelConfigError(f"grad_bucket_numel={self.grad_bucket_numel!r}: must be an integer >= 0")
        rules.grad_buckets_not_with_zero3(self.grad_bucket_numel, self.zero_stage)
        rules.zero3_reduce_every_microbatch_needs_zero3(self.zero3_reduce_every_microbatch, self.zero_stage)
        if not self.capacity_factor > 0:
            raise ParallelConfigError(f"capacity_factor={self.capacity_factor!r}: must be positive")
        rules.overlap_chunks_need_chunked_dispatcher(self.ep_overlap_chunks, self.dispatcher, dispatcher.chunked)
        rules.ulysses_degree_only_for_its_modes(self.ulysses_degree, self.cp_mode, mode.takes_ulysses_degree)
        rules.virtual_stages_need_chunked_schedule(self.virtual_stages, self.pp_schedule, schedule.chunks)

    @property
    def shards_optimizer(self) -> bool:
        return self.zero_stage >= 1 or self.distributed_optimizer

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def torch_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype or self.param_dtype]

    @property
    def mixed_precision(self) -> bool:
        """fp32 main params and main grads exist only when the model params are in a lower precision."""
        return self.torch_param_dtype.itemsize < 4
