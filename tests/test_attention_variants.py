"""Qwen2's q/k/v biases and Qwen3's QK-norm, with heads wider than hidden_size / num_heads, on parallel layouts.

One 4-rank launch trains each layout three float64 steps and compares every rank with the plain model on one
device (gradients and parameters to 1e-9, tests/layout_check.py) and with the planner (ledger and memory, byte
for byte): the biases split over tp with their weights (kv heads replicated under tp4 included) and the
QK-norm weights, replicated, whose gradients are summed over tp with and without sequence parallelism.
"""

from __future__ import annotations

import torch
from layout_check import check_layout, layout_run

from orangetron.parallel import ParallelConfig
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec
from orangetron.testing import run_distributed

torch.set_num_threads(1)

# head_dim 8 with 4 heads over a width of 16, as Qwen3's heads of 128 over widths that are not 128 x heads
QWEN = ModelSpec(name="qwen", hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=32,
                 ffn_hidden_size=24, qkv_bias=True, qk_norm=True)
MODELS = {
    "qwen": QWEN,
    "qwen-moe": QWEN.with_changes(num_kv_heads=4, num_experts=4, top_k=2, moe_ffn_hidden_size=8),
}
ROWS = 4
CASES = [
    ("qwen", Layout(tp=4), {"sequence_parallel": True}),  # kv heads (and their biases) replicated over tp pairs
    ("qwen", Layout(tp=2, dp=2), {"zero_stage": 1}),  # QK-norm gradients summed over tp without SP
    ("qwen", Layout(tp=2, dp=2), {"sequence_parallel": True, "zero_stage": 3}),
    ("qwen-moe", Layout(tp=2, dp=2), {"sequence_parallel": True, "distributed_optimizer": True}),
    ("qwen", Layout(tp=2, cp=2), {"cp_mode": "ring", "sequence_parallel": True}),
    ("qwen", Layout(cp=2, dp=2), {"cp_mode": "ulysses", "zero_stage": 2}),
    ("qwen", Layout(tp=2, pp=2), {"pp_schedule": "1f1b", "microbatches": 2}),
]


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases() -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), per_rank=ROWS) for m, layout, opts in CASES]


def test_qkv_bias_and_qk_norm_match_one_device_and_the_planner_on_every_layout():
    results = run_distributed(run_cases, 4)
    for i, (name, layout, options) in enumerate(CASES):
        check_layout([r[i] for r in results], MODELS[name], layout, _config(options), f"{name} {layout} {options}",
                     rows=ROWS)
