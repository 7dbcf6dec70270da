"""Tensor parallelism with sequence parallelism: step time against PyTorch's own, and activation memory.

1. Step time (forward, backward, AdamW) of our TP+SP against `torch.distributed.tensor.parallel.
   parallelize_module` (ColwiseParallel / RowwiseParallel / SequenceParallel, the plan torchtitan applies
   to Llama, with `loss_parallel`) on a dense Llama-style model of the same sizes built from torch's own
   layers, on the same ranks, in one run. The ratio is torch's step time over ours (above 1: ours faster).
2. The activation peak per rank with SP, measured, against (one-device peak) / tp for tp = 1, 2, 4 on a
   model whose activations dominate (a long sequence); the ratio is measured / ideal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from orangetron import memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, ModelSpec, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers

CFG = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=768, max_seq_len=4096)
BATCH, SEQ, STEPS = 2, 256, 8
LONG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_dim=192, max_seq_len=8192)
LONG_SEQ = 2048


def _tokens(step: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(step))


def _median(times: list[float]) -> float:
    return statistics.median(times[2:])  # the first steps allocate optimizer state


# ---- ours ---------------------------------------------------------------------------------------
def ours_step_s(tp: int) -> float:
    mesh = init_mesh(Layout(tp=tp))
    dp = parallelize(Transformer(CFG, seed=0), mesh, ParallelConfig(sequence_parallel=tp > 1))
    opt = dp.optimizer(lr=1e-3)
    times = []
    for step in range(STEPS):
        tokens = _tokens(step, SEQ, CFG.vocab_size)
        start = time.perf_counter()
        dp.module.loss_from_logits(dp(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return _median(times)


def ours_activation_peak(tp: int) -> int:
    mesh = init_mesh(Layout(tp=tp))
    dp = parallelize(Transformer(LONG, seed=0), mesh, ParallelConfig(sequence_parallel=tp > 1))
    tokens = _tokens(0, LONG_SEQ, LONG.vocab_size)
    with memory.track_activations(dp.module) as meter:
        dp.module.loss_from_logits(dp(tokens[:, :-1]), tokens[:, 1:]).backward()
    return meter.peak_bytes


# ---- PyTorch's tensor parallelism on torch's own layers ------------------------------------------
class TorchAttention(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, H/tp, S, D]
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TorchMLP(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TorchBlock(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = TorchAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = TorchMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TorchDecoder(nn.Module):
    """The same sizes as CFG from torch's layers (no rotary embedding: torchtitan applies it to local heads,
    elementwise, so it does not change the communication)."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TorchBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _torch_tp_plan(model: TorchDecoder, tp: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def torch_step_s(tp: int) -> float:
    from torch.distributed.tensor.parallel import loss_parallel

    model = TorchDecoder(CFG)
    _torch_tp_plan(model, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    times = []
    for step in range(STEPS):
        tokens = _tokens(step, SEQ, CFG.vocab_size)
        start = time.perf_counter()
        with loss_parallel():
            F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return _median(times)


def _line(name: str, config: dict, metric: str, value: float, unit: str, baseline: float, ratio: float) -> str:
    return json.dumps({"name": name, "config": config, "metric": metric, "value": round(value, 5), "unit": unit,
                       "baseline": round(baseline, 5), "ratio": round(ratio, 3)})


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for tp in (2, 4):
        config = {"tp": tp, "sequence_parallel": True, "model": "dense dim 256, 4 layers, GQA 8/4",
                  "batch": BATCH, "seq_len": SEQ, "backend": "gloo", "baseline": "torch parallelize_module"}
        theirs = max(run_distributed(torch_step_s, tp, args=(tp,)))
        mine = max(run_distributed(ours_step_s, tp, args=(tp,)))
        print(_line("tensor_parallel_step", config, "step_s", mine, "s", theirs, theirs / mine), flush=True)
    one_device = run_distributed(ours_activation_peak, 1, args=(1,))[0]
    for tp in (1, 2, 4):
        peak = max(run_distributed(ours_activation_peak, tp, args=(tp,)))
        config = {"tp": tp, "sequence_parallel": tp > 1, "model": "dense dim 64, 2 layers, MHA", "batch": BATCH,
                  "seq_len": LONG_SEQ, "baseline": "one-device peak / tp"}
        ideal = one_device / tp
        print(_line("tensor_parallel_activation_peak", config, "peak_bytes", peak, "B", ideal, peak / ideal),
              flush=True)
    shutdown_workers()


if __name__ == "__main__":
    main()
