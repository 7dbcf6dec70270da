"""The runtime's side of `ParallelConfig`: its torch dtypes, and what the runtime refuses of it.

The type itself lives in the spec layer (spec/parallel_config.py), where the planner's `Job` extends it; it is
re-exported here and as `orangetron.ParallelConfig`. A `ParallelConfig` may name what only the planner prices;
`check_runnable` refuses that in one line, and `ParallelModel`, `parallelize` and `TrainConfig` call it before
they build anything.
"""

from __future__ import annotations

import torch

from orangetron.spec import rules
from orangetron.spec.parallel_config import DROP_POLICIES, ParallelConfig, ParallelConfigError, check_choice
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

__all__ = ["DROP_POLICIES", "DTYPES", "ParallelConfig", "ParallelConfigError", "check_runnable"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def check_runnable(config: ParallelConfig) -> None:
    """Raise (RuleError or ParallelConfigError, one line) for an option `config` holds that the runtime does not
    run: a variant priced by the planner only, a dtype without a torch dtype here, or gradient buckets under
    ZeRO-3."""
    CONTEXT_MODES.runtime_record(config.cp_mode)
    DISPATCHERS.runtime_record(config.dispatcher)
    SCHEDULES.runtime_record(config.pp_schedule)
    check_choice("param_dtype", config.param_dtype, tuple(DTYPES))
    if config.reduce_dtype is not None:
        check_choice("reduce_dtype", config.reduce_dtype, tuple(DTYPES))
    rules.grad_buckets_not_with_zero3(config.grad_bucket_numel, config.zero_stage)
