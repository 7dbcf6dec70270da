"""The one-GPU check: kernels, one-rank training, memory and throughput on one device, in one process.

    PYTHONPATH=src python scripts/gpu_check.py --device cuda --out gpu_check.jsonl
    PYTHONPATH=src python scripts/gpu_check.py --device cpu --quick --out cpu_check.jsonl   # what CI runs

Each item writes one JSON line to --out as soon as it ends (flushed, so a run cut short keeps what it did),
with `item`, `device`, `pass` and `seconds`, and its measurements; an item that raises writes its error and
`pass: false`, and the next item runs. The exit code is 0 when every item passed. Items:

- `kernel`: `model/attention.py`'s fused seam against its float64 reference (output, log-sum-exp and the
  gradients of q, k, v), with grouped-query heads, causal and not: bf16 (the flash kernel on CUDA) within 2e-2
  and float32 (memory-efficient on CUDA) within 1e-4, as max |x - ref| / max |ref|;
- `train_dense`, `train_moe`: three one-rank steps of the tiny and tiny-moe presets; float32 on the device
  within 1e-5 (relative, every step's loss) of the same run on the CPU, bf16 within 2e-2, and a
  `--deterministic` rerun bitwise equal;
- `memory`: the CUDA allocator's peak over a run against the accounted memory categories (`ratio` to their
  sum; it passes when the peak holds at least what must coexist: the model state and the larger of gradients
  and saved activations); on a CPU, whose allocator keeps no peak, only the accounted bytes;
- `cp_replay`: every context-parallel mode's block sequence (ring, allgather, ulysses, usp, rsa over cp = 4,
  usp as 2 x 2) replayed on this one device: each emulated cp rank's query tokens and heads attend to the key
  blocks that mode brings them, in its order, through the same block functions and positions
  (`parallel/context/blocks.py`'s `attend`, `merge`, `attend_backward`, with runs from `calls.py` and
  `ring.ring_runs`), merged and scattered back; output and dq, dk, dv against float64 attention of the whole
  sequence, in bf16 and float32, within the kernel tolerances; `max_rel_error` per mode;
- `host_syncs`: forward and backward of one step of a small MoE model (2 layers, 4 experts, router losses
  on), after a warm-up step, counted by `orangetron.host_syncs` (the operations that wait for the device)
  and, on CUDA, by `torch.cuda.set_sync_debug_mode("warn")`; the budget is one per expert dispatch and none
  per attention block (on a CPU the driver's count is reported as skipped);
- `throughput`: tokens/s and MFU of the trainer's one-rank step on a fixed model (dim 2048, 16 layers,
  sequence 4096, bf16 on CUDA; a small one in float32 on CPU or with --quick) against a plain-torch step of the
  same model (SDPA, float32 weights under bf16 autocast on CUDA, fused `torch.optim.AdamW`), as `ratio` =
  ours / plain (the goal is 0.95 or more; the item passes when both ran).

Written for torch 2.11 and later, and nothing but torch and this repository (no install).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from orangetron.host_syncs import count_host_syncs
from orangetron.model import ModelConfig, Transformer, varlen
from orangetron.model.attention import Runs, _fused_op, attention_kernel, document_attention
from orangetron.model.documents import Documents
from orangetron.model.moe import MoE
from orangetron.parallel.context.blocks import attend, attend_backward, merge, runs_positions
from orangetron.parallel.context.calls import head_tail_runs, spec_runs
from orangetron.parallel.context.ring import ring_runs
from orangetron.spec.model import ModelSpec
from orangetron.train.config import TrainConfig
from orangetron.train.mfu import StepTimer, device_peak_flops
from orangetron.train.trainer import train

KERNEL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
TRAIN_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
ACCOUNTED = ("params", "grads", "main_params", "optimizer", "activations_peak")


def _gap(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|, in float64."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def kernel_case(device: torch.device, dtype: torch.dtype, causal: bool, shape: tuple[int, int, int, int, int]
                ) -> dict[str, Any]:
    """One fused-kernel call and its backward against the float64 reference on the same inputs."""
    b, s, hq, hk, d = shape
    gen = torch.Generator().manual_seed(0)
    q64, k64, v64 = (torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for h in (hq, hk, hk))
    grad_out = torch.randn(b, s, hq, d, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q64, k64, v64))
    out, lse = attention_kernel(q, k, v, causal=causal)
    out.backward(grad_out.to(device, dtype))
    refs = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref_out, ref_lse = attention_kernel(*refs, causal=causal, impl="reference")
    ref_out.backward(grad_out)
    gaps = {"out": _gap(out, ref_out), "lse": _gap(lse, ref_lse),
            **{f"d{n}": _gap(t.grad, r.grad) for n, t, r in zip("qkv", (q, k, v), refs, strict=True)}}
    op = _fused_op(q)
    kernel = op.__name__.removeprefix("_cuda_") if op is not None else f"{device.type} fused"
    return {"dtype": str(dtype).removeprefix("torch."), "causal": causal, "kernel": kernel,
            "max_gap": max(gaps.values()), "gaps": gaps}


def item_kernel(device: torch.device, quick: bool) -> dict[str, Any]:
    shape = (1, 64, 4, 2, 32) if quick or device.type == "cpu" else (2, 1024, 16, 4, 128)  # (B, S, Hq, Hk, D)
    cases = [kernel_case(device, dtype, causal, shape)
             for dtype in (torch.bfloat16, torch.float32) for causal in (True, False)]
    ok = all(c["max_gap"] <= KERNEL_TOLERANCE[getattr(torch, c["dtype"])] for c in cases)
    return {"shape_bshkd": list(shape), "cases": cases, "pass": ok}


def item_packed(device: torch.device, quick: bool) -> dict[str, Any]:
    """Packed documents on one device in bf16 (one varlen call on CUDA, one fused call per document elsewhere),
    forward and backward, against float64 attention under the dense block-diagonal causal mask."""
    rows, seq, hq, hk, d = (2, 64, 4, 2, 32) if quick or device.type == "cpu" else (2, 4096, 16, 4, 128)
    lengths = [1, 7, seq // 2, seq - seq // 2 - 8]  # one token, short, long
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(rows, -1)
    gen = torch.Generator().manual_seed(0)
    q64, k64, v64 = (torch.randn(rows, seq, h, d, generator=gen, dtype=torch.float64) for h in (hq, hk, hk))
    grad_out = torch.randn(rows, seq, hq, d, generator=gen, dtype=torch.float64)
    q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
    out, _ = document_attention(q, k, v, Documents.from_ids(ids.to(device)))
    out.backward(grad_out.to(device, torch.bfloat16))
    refs = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    visible = torch.ones(seq, seq, dtype=torch.bool).tril() & (ids[0][:, None] == ids[0][None, :])
    kh, vh = (t.repeat_interleave(hq // hk, dim=2).transpose(1, 2) for t in refs[1:])
    scores = (refs[0].transpose(1, 2) @ kh.transpose(-1, -2) * d ** -0.5).masked_fill(~visible, float("-inf"))
    ref_out = (scores.softmax(-1) @ vh).transpose(1, 2)
    ref_out.backward(grad_out)
    gaps = {"out": _gap(out, ref_out), **{f"d{n}": _gap(t.grad, r.grad) for n, t, r in zip("qkv", (q, k, v), refs,
                                                                                          strict=True)}}
    path = "varlen" if varlen.kernel(q) is not None else "per-document calls"
    return {"shape_bshkd": [rows, seq, hq, hk, d], "documents": lengths, "path": path, "gaps": gaps,
            "pass": max(gaps.values()) <= KERNEL_TOLERANCE[torch.bfloat16]}


def _run(model: str, device: str, dtype: str, deterministic: bool = False) -> dict[str, Any]:
    cfg = TrainConfig(model=model, steps=3, seq_len=32, batch_size=4, warmup=0, corpus_bytes=40_000,
                      param_dtype=dtype, device=device, deterministic=deterministic)
    return train(cfg, progress=False)


def _loss_gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def item_train(model: str) -> Callable[[torch.device, bool], dict[str, Any]]:
    def run(device: torch.device, quick: bool) -> dict[str, Any]:
        first = _run(model, device.type, "float32", deterministic=True)
        rerun = _run(model, device.type, "float32", deterministic=True)
        host32 = first if device.type == "cpu" else _run(model, "cpu", "float32")
        bf16 = _run(model, device.type, "bfloat16")
        host16 = bf16 if device.type == "cpu" else _run(model, "cpu", "bfloat16")
        gaps = {"float32": _loss_gap(first["losses"], host32["losses"]),
                "bfloat16": _loss_gap(bf16["losses"], host16["losses"])}
        bitwise = first["losses"] == rerun["losses"]
        ok = bitwise and all(gaps[k] <= TRAIN_TOLERANCE[k] for k in gaps) and all(map(math.isfinite, first["losses"]))
        return {"model": model, "steps": 3, "losses": first["losses"], "gap_vs_cpu": gaps,
                "deterministic_rerun_bitwise_equal": bitwise, "pass": ok}
    return run


def item_memory(device: torch.device, quick: bool) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = _run("tiny-moe", device.type, "float32")
    mem = result["memory"][0]
    accounted = sum(mem.get(k, 0) for k in ACCOUNTED)
    peak = mem.get("allocator_peak")
    # Gradients are freed between steps and grow in backward as the saved activations go, so the categories'
    # peaks need not coincide; what must coexist is the model state and the larger of the two. The allocator
    # also holds what no category names (logits, workspaces), so its peak may exceed the sum.
    floor = sum(mem.get(k, 0) for k in ("params", "main_params", "optimizer")) \
        + max(mem.get("grads", 0), mem.get("activations_peak", 0))
    ok = accounted > 0 and (peak is None or peak >= 0.95 * floor)
    return {"accounted_bytes": accounted, "by_category": {k: mem.get(k, 0) for k in ACCOUNTED},
            "coexisting_floor_bytes": floor, "allocator_peak": peak,
            "ratio": None if peak is None else peak / accounted, "pass": ok}


CP, ULYSSES = 4, 2  # the emulated cp degree, and usp's all-to-all factor (a ring of 2 groups of 2)


class Member(NamedTuple):
    """One emulated rank's queries: their global positions (runs, in its tensor order), its query heads and kv
    heads ([start, stop)), and the key runs it attends to, block by block, in the mode's order."""

    q_runs: Runs
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    blocks: list[Runs]


def _head_share(j: int, n: int, hq: int, hk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Query and kv heads of all-to-all rank j of n: kv heads are repeated up to n first when fewer (as
    `ulysses.attention` does), so rank j then gets kv head j * hk // n."""
    kv = max(hk // n, 1)
    return (j * hq // n, (j + 1) * hq // n), (j * hk // n, j * hk // n + kv)


def cp_members(mode: str, seq: int, hq: int, hk: int) -> list[Member]:
    """Each mode's block sequence over `CP` ranks: whose tokens and heads a rank holds, and which keys arrive."""
    every = (0, hq), (0, hk)
    gathered = spec_runs((seq, CP, None))  # every rank's shard in rank order
    if mode in ("ring", "rsa"):  # K,V (rsa: K, then V) come round the ring: rank r - step at each step
        return [Member(head_tail_runs(seq, CP, r), *every,
                       [head_tail_runs(seq, CP, (r - step) % CP) for step in range(CP)]) for r in range(CP)]
    if mode == "allgather":  # one block: every rank's K,V in rank order
        return [Member(head_tail_runs(seq, CP, r), *every, [gathered]) for r in range(CP)]
    if mode == "ulysses":  # the whole sequence in rank order, for this rank's share of the heads
        return [Member(gathered, *_head_share(j, CP, hq, hk), [gathered]) for j in range(CP)]
    if mode == "usp":  # Ulysses within groups of ULYSSES ranks, a ring over the groups
        layout, members = ("usp", seq, CP, ULYSSES, None), CP // ULYSSES
        return [Member(ring_runs(layout, m), *_head_share(j, ULYSSES, hq, hk),
                       [ring_runs(layout, (m - step) % members) for step in range(members)])
                for m in range(members) for j in range(ULYSSES)]
    raise ValueError(f"cp_replay: no block sequence for mode {mode!r}")


def _part(x: torch.Tensor, runs: Runs, heads: tuple[int, int]) -> torch.Tensor:
    return x.index_select(1, runs_positions(runs, x.device))[:, :, heads[0]:heads[1]]


def _forward(m: Member, qm: torch.Tensor, kvs: list, impl: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (out, lse): its blocks' partial results merged in log-sum-exp form, as the modes merge them."""
    out = torch.zeros(qm.shape, dtype=torch.promote_types(qm.dtype, torch.float32), device=qm.device)
    lse = torch.full((qm.shape[0], qm.shape[2], qm.shape[1]), float("-inf"), dtype=out.dtype, device=qm.device)
    for (kb, vb), runs in zip(kvs, m.blocks, strict=True):
        merge(out, lse, *attend(qm, kb, vb, m.q_runs, runs, True, scale, impl))
    return out.to(qm.dtype), lse  # handed on in the input dtype, as every mode does


def replay(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of causal attention over q [B, S, Hq, D], k, v [B, S, Hk, D] (natural order), computed
    as `mode` computes it across `CP` ranks, on this one device; gradients summed in float64. rsa has only the
    matmul form ("reference")."""
    impl, scale = "reference" if mode == "rsa" else "fused", q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v))
    for m in cp_members(mode, q.shape[1], q.shape[2], k.shape[2]):
        qm, go = _part(q, m.q_runs, m.heads), _part(grad_out, m.q_runs, m.heads)
        kvs = [(_part(k, runs, m.kv_heads), _part(v, runs, m.kv_heads)) for runs in m.blocks]
        om, lse = _forward(m, qm, kvs, impl, scale)
        rows, (h0, h1), (g0, g1) = runs_positions(m.q_runs, q.device), m.heads, m.kv_heads
        out[:, rows, h0:h1] = om
        for (kb, vb), runs in zip(kvs, m.blocks, strict=True):
            grads = [g.double() for g in attend_backward(qm, kb, vb, om, lse, go, m.q_runs, runs, True, scale, impl)]
            keys = runs_positions(runs, q.device)  # distinct within a block: += adds each once
            dq[:, rows, h0:h1] += grads[0]
            dk[:, keys, g0:g1] += grads[1]
            dv[:, keys, g0:g1] += grads[2]
    return out, dq, dk, dv


def _reference(shape: tuple[int, int, int, int, int], device: torch.device) -> tuple[list[torch.Tensor], list]:
    """(inputs q, k, v, grad_out in float64, [out, dq, dk, dv] of float64 attention of the whole sequence), both
    on `device`: the one reference every mode and dtype is held to."""
    b, s, hq, hk, d = shape
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(b, s, h, d, generator=gen, dtype=torch.float64).to(device) for h in (hq, hk, hk, hq)]
    refs = [t.clone().requires_grad_() for t in inputs[:3]]
    ref_out, _ = attention_kernel(*refs, causal=True, impl="reference")
    ref_out.backward(inputs[3])
    return inputs, [ref_out.detach(), *(r.grad for r in refs)]


def cp_replay_case(mode: str, dtype: torch.dtype, inputs: list[torch.Tensor], reference: list) -> dict[str, Any]:
    """One mode's replay in `dtype` against the float64 reference, forward and backward."""
    got = replay(mode, *(t.to(dtype) for t in inputs))
    gaps = {name: _gap(x, ref) for name, x, ref in zip(("out", "dq", "dk", "dv"), got, reference, strict=True)}
    return {"max_gap": max(gaps.values()), "gaps": gaps}


def item_cp_replay(device: torch.device, quick: bool) -> dict[str, Any]:
    shape = (1, 32, 8, 2, 16) if quick or device.type == "cpu" else (1, 2048, 8, 2, 128)  # (B, S, Hq, Hk, D)
    inputs, reference = _reference(shape, device)
    dtypes = (torch.bfloat16, torch.float32)
    modes = {mode: {str(dt).removeprefix("torch."): cp_replay_case(mode, dt, inputs, reference) for dt in dtypes}
             for mode in ("ring", "allgather", "ulysses", "usp", "rsa")}
    ok = all(case["max_gap"] <= KERNEL_TOLERANCE[getattr(torch, dt)]
             for cases in modes.values() for dt, case in cases.items())
    return {"cp": CP, "ulysses_degree": ULYSSES, "shape_bshkd": list(shape), "modes": modes,
            "max_rel_error": {mode: max(c["max_gap"] for c in cases.values()) for mode, cases in modes.items()},
            "pass": ok}


SYNC_MODEL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, n_experts=4, top_k=2,
                  moe_ffn_dim=16, n_shared_experts=1, aux_loss_coef=0.01, router_z_loss_coef=0.001,
                  router_bias_rate=0.001)


@contextmanager
def cuda_sync_warnings(device: torch.device) -> Iterator[list | None]:
    """On CUDA, the warnings `torch.cuda.set_sync_debug_mode("warn")` raises inside the block (one per sync);
    elsewhere None."""
    if device.type != "cuda":
        yield None
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def sync_warnings(caught: list) -> int:
    """The syncs among warnings caught under `cuda_sync_warnings`: torch words each "...synchronizing CUDA
    operation"."""
    return sum("synchronizing" in str(w.message) for w in caught)


def _step(model: Transformer, rows: torch.Tensor) -> None:
    logits = model(rows[:, :-1])
    model.loss_from_logits(logits, rows[:, 1:]).backward()


def item_host_syncs(device: torch.device, quick: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Transformer(ModelConfig(**SYNC_MODEL), seed=0, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, SYNC_MODEL["vocab_size"], (2, 65), generator=gen).to(device)
    _step(model, rows)  # warm-up: first calls may set things up
    with count_host_syncs() as syncs, cuda_sync_warnings(device) as caught:
        _step(model, rows)
    dispatches = sum(isinstance(m, MoE) for m in model.modules())
    driver = None if caught is None else sync_warnings(caught)
    regions = {r: sum(s.region == r for s in syncs) for r in ("attention", "experts", "other")}
    ok = len(syncs) <= dispatches and regions["attention"] == 0 and (driver is None or driver <= dispatches)
    return {"dtype": str(dtype).removeprefix("torch."), "attention_blocks": SYNC_MODEL["n_layers"],
            "dispatches": dispatches, "budget": dispatches, "counted": len(syncs), "by_region": regions,
            "sites": sorted({s.site for s in syncs}),
            "per_dispatch": len(syncs) / dispatches,
            "cuda_sync_debug": driver if driver is not None else "skipped: no CUDA device", "pass": ok}


def _throughput_spec(device: torch.device, quick: bool) -> tuple[ModelSpec, int]:
    if device.type == "cuda" and not quick:
        return ModelSpec(name="check-2048x16", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4,
                         vocab_size=32768, ffn_hidden_size=5632, max_seq_len=4096), 4096
    return ModelSpec(name="check-small", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=512, ffn_hidden_size=192, max_seq_len=128), 128


class _Block(nn.Module):
    """A Llama block in plain torch: RMSNorm, rotary GQA attention through SDPA, SwiGLU."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=spec.norm_eps), nn.RMSNorm(h, eps=spec.norm_eps)
        self.wq = nn.Linear(h, spec.num_heads * hd, bias=False)
        self.wkv = nn.Linear(h, 2 * spec.num_kv_heads * hd, bias=False)
        self.wo = nn.Linear(spec.num_heads * hd, h, bias=False)
        self.w13 = nn.Linear(h, 2 * spec.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(spec.ffn_hidden_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.wq(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]
        k, v = self.wkv(y).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, Hk, S, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.w13(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PlainLM(nn.Module):
    """The throughput model in plain torch, the baseline a user would write."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.emb = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.num_layers))
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.out = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        inv = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim)
        angles = torch.arange(spec.max_seq_len, dtype=torch.float64)[:, None] * inv  # [S, D/2]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _plain_tokens_per_s(spec: ModelSpec, seq: int, batch: int, steps: int, device: torch.device) -> float:
    model = PlainLM(spec).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1), generator=gen).to(device)
    timer, seconds = StepTimer(device), []
    for step in range(steps + 1):  # the first step warms the kernels up and is not timed
        timer.start()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):  # ours: float32 on CPU
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the step ends when its loss is on the host, as the trainer's does
        if step:
            seconds.append(timer.stop())
    del model, opt
    return batch * seq * len(seconds) / sum(seconds)


def item_throughput(device: torch.device, quick: bool) -> dict[str, Any]:
    spec, seq = _throughput_spec(device, quick)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    steps = 4
    cfg = TrainConfig(model=spec, steps=steps + 1, seq_len=seq, batch_size=1, warmup=0, param_dtype=dtype,
                      device=device.type, corpus_bytes=max(40_000, 8 * seq), eval_batches=1,
                      threads=None if device.type == "cuda" else 1)
    ours = train(cfg, progress=False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the trainer runs (`--threads 1`)
    try:
        plain = _plain_tokens_per_s(spec, seq, 1, steps, device)
    finally:
        torch.set_num_threads(threads)
    peak, source = device_peak_flops(getattr(torch, dtype), device)
    return {"model": spec.name, "seq_len": seq, "dtype": dtype, "tokens_per_s": ours["tokens_per_s"],
            "mfu": ours["mfu"], "peak_flops": peak, "peak_source": source, "plain_tokens_per_s": plain,
            "ratio": ours["tokens_per_s"] / plain, "meets_goal_0.95": ours["tokens_per_s"] / plain >= 0.95,
            "pass": ours["tokens_per_s"] > 0 and plain > 0}


ITEMS: dict[str, Callable[[torch.device, bool], dict[str, Any]]] = {
    "kernel": item_kernel,
    "train_dense": item_train("tiny"),
    "train_moe": item_train("tiny-moe"),
    "memory": item_memory,
    "packed": item_packed,
    "cp_replay": item_cp_replay,
    "host_syncs": item_host_syncs,
    "throughput": item_throughput,
}


def run_items(device: torch.device, quick: bool, out: Path, names: list[str]) -> bool:
    """Run the named items in order, appending one JSON line per item to `out`; True when all passed."""
    passed = True
    with open(out, "w", encoding="utf-8") as f:
        for name in names:
            start = time.perf_counter()
            try:
                line = {"item": name, "device": str(device), **ITEMS[name](device, quick)}
            except Exception as err:  # noqa: BLE001 - one failed item must not hide the others
                line = {"item": name, "device": str(device), "pass": False, "error": f"{type(err).__name__}: {err}",
                        "traceback": traceback.format_exc(limit=8)}
            line["seconds"] = round(time.perf_counter() - start, 2)
            passed &= bool(line["pass"])
            f.write(json.dumps(line) + "\n")
            f.flush()
            print(json.dumps({k: line[k] for k in ("item", "pass", "seconds")}), file=sys.stderr, flush=True)
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--out", required=True, help="JSON lines, one per item, written as each ends")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere (the throughput model too)")
    parser.add_argument("--items", nargs="+", choices=list(ITEMS), default=list(ITEMS))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda: torch sees no CUDA GPU here", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return 0 if run_items(device, args.quick, Path(args.out), args.items) else 1


if __name__ == "__main__":
    sys.exit(main())
