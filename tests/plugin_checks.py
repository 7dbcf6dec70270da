"""The plugin variants (tests/variants_plugin.py) against one device and against their registered costs.

Run by tests/test_plugins.py in a process whose environment names the plugin (ORANGETRON_PLUGINS), so that
the ranks it starts load the plugin through the hook, as any launch would. Every case trains float64 steps
and must equal the plain single-device model to 1e-9, with each rank's ledger and memory, activation peak
included, equal to `plan.bridge.predicted_step`, which sums the registered costs. The MoE model routes every
token to both of its experts, so even the dispatch's records and activations are exact.
"""

from __future__ import annotations

from layout_check import check_layout, layout_run

from orangetron.model import ModelConfig
from orangetron.parallel import ParallelConfig
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
MODELS = {"dense": ModelConfig(**BASE),
          "moe": ModelConfig(**BASE, n_experts=4, top_k=4, moe_ffn_dim=8)}
CASES = [("dense", Layout(cp=2), {"cp_mode": "allgather-split"}, 2),
         ("moe", Layout(dp=2, ep=2), {"dispatcher": "allgather-fixed"}, 2),
         ("dense", Layout(pp=2), {"pp_schedule": "eager-1f1b", "microbatches": 4}, 4)]
SEQ = 16


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases(cases: list) -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), seq=SEQ, per_rank=rows) for m, layout, opts, rows in cases]


def main(cases: list = CASES) -> None:
    results = run_distributed(run_cases, 2, args=(cases,))
    for i, (name, layout, options, rows) in enumerate(cases):
        check_layout([r[i] for r in results], MODELS[name], layout, _config(options), f"{name} {layout} {options}",
                     seq=SEQ, rows=rows, balanced_routing=layout.ep > 1)
        print(f"ok {name} {layout} {options}", flush=True)


if __name__ == "__main__":
    main()
