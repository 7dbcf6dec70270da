"""Training-step throughput of the MoE presets against dense models of the same width.

Prints one JSON object per line: {"name", "config", "metric", "value", "unit", "baseline", "ratio"}.
A step is forward + backward + AdamW update on one CPU thread, as `orangetron train` runs it; the
value is the median over a few timed steps after warmup. ratio = MoE tokens/s / dense tokens/s.
Run: PYTHONPATH=src python benchmarks/train_step.py  (about 20 s on a 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from orangetron.model import ModelSpec, Transformer, model_preset


def step_seconds(cfg: ModelSpec, batch: int, seq_len: int, *, warmup: int = 2, repeat: int = 5) -> float:
    """Median wall time of one training step of `cfg` on a [batch, seq_len] byte batch."""
    model = Transformer(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(0)
    samples = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)  # [B, S+1]
    times = []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        model.loss(samples[:, :-1], samples[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dense_twin(cfg: ModelSpec) -> ModelSpec:
    """The same model with every MoE layer replaced by a dense SwiGLU of width ffn_dim."""
    return dataclasses.replace(cfg, num_experts=0, top_k=0, num_shared_experts=0)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    cases = [("tiny-moe", "tiny", model_preset("tiny"), 8, 128),
             ("small-moe", "dense twin", dense_twin(model_preset("small-moe")), 8, 128)]
    for name, baseline_name, dense_cfg, batch, seq_len in cases:
        moe_cfg = model_preset(name)
        tokens = batch * seq_len
        moe = tokens / step_seconds(moe_cfg, batch, seq_len)
        dense = tokens / step_seconds(dense_cfg, batch, seq_len)
        print(json.dumps({
            "name": "train_step_tokens_per_s",
            "config": {"model": name, "baseline_model": baseline_name, "batch": batch, "seq_len": seq_len,
                       "dim": moe_cfg.dim, "n_experts": moe_cfg.n_experts, "top_k": moe_cfg.top_k,
                       "threads": 1, "dtype": "float32"},
            "metric": "tokens_per_s",
            "value": round(moe, 1),
            "unit": "tokens/s",
            "baseline": round(dense, 1),
            "ratio": round(moe / dense, 4),
        }), flush=True)


if __name__ == "__main__":
    main()
