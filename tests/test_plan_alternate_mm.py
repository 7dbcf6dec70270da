"""torchtitan's op-level selective checkpointing (`recompute_modules=["alternate_mm"]`): the planner's bytes kept
per layer and FLOPs replayed per layer against torch's own checkpointing, measured on a small Llama block in
float32. The policy below is written from torchtitan's description of it (save every output of the matmuls and
the fused attention kernel, except every second matmul of the layer); what the block keeps after its forward is
counted from the live tensors, and what it replays from the matmul FLOPs its backward runs beyond the gradients'.
"""

import gc
from collections import defaultdict
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from orangetron.plan.activations import layer_activation_bytes, stage_activation_bytes
from orangetron.plan.compute import linear_parts
from orangetron.plan.timing import layer_cost, step_time
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, validate

B, S, H, HEADS, KV, D, FFN = 2, 32, 64, 4, 2, 16, 176
MODEL = ModelSpec(name="llama-block", hidden_size=H, num_layers=2, num_heads=HEADS, num_kv_heads=KV, head_dim=D,
                  ffn_hidden_size=FFN, mlp="swiglu", vocab_size=100)
# CPU's fused attention op stands for CUDA's flash and memory-efficient ones in torchtitan's list.
SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy(count: dict, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    mode = "recompute" if ctx.is_recompute else "forward"
    if func == torch.ops.aten.mm.default:
        count[mode] += 1
    keep = func in SAVED_OPS and not (func == torch.ops.aten.mm.default and count[mode] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = torch.cos(torch.arange(S)[:, None, None] * 0.01 * torch.arange(half))
    return torch.cat([x[..., :half] * cos - x[..., half:], x[..., half:] * cos + x[..., :half]], -1)


def _block(w: dict, x: torch.Tensor) -> torch.Tensor:
    """torchtitan's Llama layer: its matmuls run Q, K, V, O, gate (w1), up (w3), down (w2)."""
    y = _rms(x)
    q, k, v = (F.linear(y, w[n]).view(B, S, -1, D) for n in ("wq", "wk", "wv"))
    q, k = _rope(q), _rope(k).repeat_interleave(HEADS // KV, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                       v.repeat_interleave(HEADS // KV, 2).transpose(1, 2), is_causal=True)
    h = x + F.linear(o.transpose(1, 2).reshape(B, S, HEADS * D), w["wo"])
    z = _rms(h)
    return h + F.linear(F.silu(F.linear(z, w["w1"])) * F.linear(z, w["w3"]), w["w2"])


def _live_bytes(skip: set[int]) -> int:
    """Bytes of the live tensors' storages, each once, less `skip`'s (0-dim constants autograd keeps apart)."""
    gc.collect()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and t.dim() > 0}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def _measured() -> tuple[int, int]:
    """(bytes one layer keeps after its forward, its input included; matmul FLOPs its backward replays)."""
    torch.manual_seed(0)
    shapes = {"wq": (HEADS * D, H), "wk": (KV * D, H), "wv": (KV * D, H), "wo": (H, HEADS * D), "w1": (FFN, H),
              "w3": (FFN, H), "w2": (H, FFN)}
    w = {name: (0.1 * torch.randn(shape)).requires_grad_() for name, shape in shapes.items()}
    x = torch.randn(B, S, H, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in w.values()}
    before = _live_bytes(skip)
    with FlopCounterMode(display=False) as forward:
        out = checkpoint(partial(_block, w), x, use_reentrant=False, preserve_rng_state=False,
                         context_fn=lambda: create_selective_checkpoint_contexts(partial(_policy, defaultdict(int))))
    kept = _live_bytes(skip | {out.untyped_storage().data_ptr()}) - before + x.numel() * x.element_size()
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    mm = torch.ops.aten.mm
    replayed = backward.get_flop_counts()["Global"][mm] - 2 * forward.get_flop_counts()["Global"][mm]
    return kept, replayed


def test_a_layer_keeps_and_replays_what_torch_checkpointing_does():
    kept, replayed = _measured()
    job = Job(seq_len=S, micro_batch=B, param_dtype="float32", recompute_modules=("alternate_mm",))
    assert layer_activation_bytes(MODEL, Degrees(), job, False) == kept
    # K (64 x 32), O (64 x 64) and up (64 x 176) on 64 rows: 2 x 64 x 64 x 272 FLOPs.
    assert replayed == 2 * B * S * H * (KV * D + H + FFN)
    plain = Job(seq_len=S, micro_batch=B, param_dtype="float32", global_batch=B)
    cluster = make_cluster("h100", 1)
    extra = step_time(MODEL, Degrees(), replace(job, global_batch=B), cluster).hardware_flops - \
        step_time(MODEL, Degrees(), plain, cluster).hardware_flops
    assert extra == pytest.approx(replayed * MODEL.num_layers, rel=1e-12)


def test_the_first_backward_brings_back_one_layer():
    """While a layer's backward runs, its replay rebuilds what the policy dropped. The first of two 1F1B stages
    (one layer each) holds two micro-batches: twice the kept bytes and the one layer rebuilt, where keeping
    everything holds the layer whole twice."""
    plain = Job(seq_len=S, micro_batch=B, param_dtype="float32", microbatches=4)
    job = replace(plain, recompute_modules=("alternate_mm",))
    whole, kept = (layer_activation_bytes(MODEL, Degrees(pp=2), j, False) for j in (plain, job))
    assert 0 < kept < whole
    assert stage_activation_bytes(MODEL, Degrees(pp=2), plain, 0) - \
        stage_activation_bytes(MODEL, Degrees(pp=2), job, 0) == 2 * whole - (2 * kept + whole - kept)


def test_a_replay_costs_three_projections_and_the_memory_bound_work():
    """The replay runs K (64 -> 32), O (64 -> 64) and up (64 -> 176) forward on the 64 rows, and every
    memory-bound op of the layer again: as much as the layer's own forward has."""
    cluster = make_cluster("h100", 1)
    plain = Job(seq_len=S, micro_batch=B)
    job = replace(plain, recompute_modules=("alternate_mm",))
    projections = sum(linear_parts(B * S, H, n, cluster.gpu, "bfloat16", 2.0)[0] for n in (KV * D, H, FFN))
    cost = layer_cost(MODEL, Degrees(), job, cluster, False)
    assert cost.replay == pytest.approx(projections + layer_cost(MODEL, Degrees(), plain, cluster, False).elementwise,
                                        rel=1e-12)


@pytest.mark.parametrize("job, model, deg, match", [
    (dict(recompute="full"), MODEL, Degrees(), "full recompute already replays"),
    (dict(recompute="selective"), MODEL, Degrees(), "stands alone, with recompute='none'"),
    (dict(modules=("alternate_mm", "mlp")), MODEL, Degrees(), "stands alone"),
    (dict(), MODEL.with_changes(bias=True), Degrees(), "has no Llama block"),
    (dict(), MODEL.with_changes(mlp="gelu"), Degrees(), "has no Llama block"),
    (dict(), MODEL.with_changes(num_experts=4, top_k=2, moe_ffn_hidden_size=32), Degrees(ep=1),
     "has no Llama block"),
    (dict(), MODEL, Degrees(tp=2), "at tp=2, cp=1"),
    (dict(), MODEL, Degrees(cp=2), "at tp=1, cp=2"),
    (dict(fp8=True), MODEL, Degrees(), "fp8=True"),
])
def test_what_the_policy_is_not_priced_for_is_refused(job, model, deg, match):
    modules = job.pop("modules", ("alternate_mm",))
    with pytest.raises(ValueError, match=match):
        validate(model, deg, Job(seq_len=S, recompute_modules=modules, **job))
