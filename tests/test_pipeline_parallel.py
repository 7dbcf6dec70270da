"""Pipeline parallelism: every schedule against one device and against the planner.

Each stage runs `plan.schedule.actions` for its rank; losses, every gradient and the final parameters must
equal the plain single-device model in float64, and each stage's ledger and model-state memory must equal
`plan.bridge.predicted_step(..., stage=s)`.
"""

from __future__ import annotations

import pytest
from layout_check import check_layout, layout_run

from orangetron.layout import Layout
from orangetron.model import ModelConfig
from orangetron.parallel import ParallelConfig
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
MODELS = {
    "dense": ModelConfig(**BASE),
    "moe": ModelConfig(**{**BASE, "n_layers": 8, "n_kv_heads": 4}, n_experts=4, top_k=2, moe_ffn_dim=8,
                       n_shared_experts=1),
}
ROWS = 4  # sequences per data-parallel rank and step
CASES = {
    2: [("dense", Layout(pp=2), {"pp_schedule": s, "microbatches": 4}) for s in ("gpipe", "1f1b")]
    + [("dense", Layout(pp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2}),
       ("moe", Layout(pp=2), {"pp_schedule": "interleaved", "microbatches": 4, "virtual_stages": 2})],
    4: [("dense", Layout(pp=4), {"pp_schedule": s, "microbatches": 4}) for s in ("gpipe", "1f1b")]
    + [("moe", Layout(pp=4), {"pp_schedule": "interleaved", "microbatches": 4, "virtual_stages": 2}),
       ("moe", Layout(tp=2, pp=2), {"pp_schedule": "1f1b", "microbatches": 2, "sequence_parallel": True}),
       ("dense", Layout(cp=2, pp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2}),
       ("moe", Layout(pp=2, dp=2, ep=2), {"pp_schedule": "gpipe", "microbatches": 2, "zero_stage": 2})],
    8: [("moe", Layout(tp=2, cp=2, pp=2), {"pp_schedule": "1f1b", "microbatches": 2, "sequence_parallel": True,
                                             "distributed_optimizer": True}),
        ("moe", Layout(tp=2, pp=2, dp=2, ep=2), {"pp_schedule": "interleaved", "microbatches": 2,
                                                  "virtual_stages": 2, "zero_stage": 1})],
}


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases(world: int) -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), per_rank=ROWS) for m, layout, opts in CASES[world]]


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_parallel_matches_one_device_and_the_planner(world):
    results = run_distributed(run_cases, world, args=(world,))
    for i, (model_name, layout, options) in enumerate(CASES[world]):
        check_layout([r[i] for r in results], MODELS[model_name], layout, _config(options),
                     f"{model_name} {layout} {options}", rows=ROWS)
