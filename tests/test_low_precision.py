"""Low precision checked by value: each path that computes in bfloat16 or float32 against float64 in the
same test, within a tolerance derived from the dtype and the operation, never tuned to the result.

u is the unit roundoff, half the gap between 1 and the next number: bfloat16 2^-8 (8 significant bits),
float32 2^-24, float64 2^-53. The bounds used:
- a value x rounded once to a dtype is off by at most u|x|;
- a sum of n terms, added one after another or in any tree, is off by at most gamma(n - 1) * sum|x_i|,
  where gamma(m) = m u / (1 - m u); when each term is rounded first, gamma(n) * sum|x_i|;
- a product of two bfloat16 numbers (8 + 8 significant bits) is exact in float32 (24 bits).
Each test also computes the slip it guards against (a table in the model dtype, an unshifted exponential,
a merge in the input dtype, logits in bfloat16) and shows that it breaks the tolerance, so the tolerance is
not loose enough to pass anything. docs/runtime.md ("Precision") lists which path computes in which dtype.

One launch of 8 gloo ranks runs every multi-rank case: ring and USP attention at cp 8, the gradient
reduction at dp 8 and the vocabulary-parallel cross entropy at tp 2 (x dp 4).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.model.layers import rope_cos_sin
from orangetron.model.moe import Router, choose_experts
from orangetron.model.token_io import TokenIO
from orangetron.parallel import DataParallel, ParallelConfig, context
from orangetron.parallel.context import ring
from orangetron.parallel.context.blocks import block_forward, merge
from orangetron.parallel.context.sharding import head_tail_indices
from orangetron.parallel.tensor import TensorParallelIO
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

WORLD = 8


def unit_roundoff(dtype: torch.dtype) -> float:
    """u of `dtype`: half of torch's eps (the gap between 1 and the next number)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """The factor bounding n successive roundings: n u / (1 - n u)."""
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu)


def worst_ratio(got: torch.Tensor, want: torch.Tensor, tolerance: torch.Tensor | float) -> float:
    """max |got - want| / tolerance, elementwise (inf where the tolerance is 0 and the values differ)."""
    err = (got.double() - want.double()).abs()
    tol = torch.as_tensor(tolerance, dtype=torch.float64).expand_as(err)
    ratio = torch.where(err == 0, torch.zeros_like(err), err / tol)
    return ratio.max().item()


# ---- 1. rotary tables past 4096 positions ---------------------------------------------------------------
ROPE_POSITIONS = torch.tensor([0, 1, 4095, 4097, 8191, 8193, 12345, 16385, 32767, 40001, 65535, 65537])
ROPE_HEAD_DIM, ROPE_THETA = 16, 10000.0


def rope_reference() -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, D/2] in float64 from Python's own powers (not the runtime's formula)."""
    inv_freq = torch.tensor([ROPE_THETA ** (-2 * i / ROPE_HEAD_DIM) for i in range(ROPE_HEAD_DIM // 2)],
                            dtype=torch.float64)
    angles = ROPE_POSITIONS.double()[:, None] * inv_freq
    return angles.cos(), angles.sin()


def rope_tolerance(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The table rounded once to `dtype` (u|x|), after angles that both sides form in float64: an angle
    p * f is off by a few float64 roundings of its size (4 u64 p), and cos, sin move by at most as much."""
    angle_error = 4 * unit_roundoff(torch.float64) * ROPE_POSITIONS.double().max()
    return unit_roundoff(dtype) * reference.abs() + (1 + unit_roundoff(dtype)) * angle_error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_rotary_tables_past_4096_are_the_float64_angles_rounded_once(dtype):
    want_cos, want_sin = rope_reference()
    cos, sin = rope_cos_sin(ROPE_POSITIONS, ROPE_HEAD_DIM, ROPE_THETA, dtype)
    assert cos.dtype == sin.dtype == dtype
    for name, got, want in (("cos", cos, want_cos), ("sin", sin, want_sin)):
        ratio = worst_ratio(got, want, rope_tolerance(want, dtype))
        assert ratio <= 1, f"{dtype} {name}: error {ratio:.3g} x the tolerance"
    # The slip: angles formed in the table's dtype. bfloat16 holds integers exactly only up to 256 (float32
    # up to 2^24), and rounding an angle near 65537 rad may move it by up to u * 65537 (256 rad in bfloat16,
    # 0.004 in float32), far past the tolerance.
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, ROPE_HEAD_DIM, 2, dtype=dtype) / ROPE_HEAD_DIM)
    slipped = (ROPE_POSITIONS.to(dtype)[:, None] * inv_freq).cos()
    assert worst_ratio(slipped, want_cos, rope_tolerance(want_cos, dtype)) > 1


# ---- 2. cross entropy with logits that overflow exp -----------------------------------------------------
# (logits dtype, magnitude, spread): rows alternate around +magnitude and -magnitude, where exp without the
# max shift overflows to inf and underflows to 0. bfloat16 at 3e4 holds multiples of 128 only.
CE_CASES = {"float32_1e4": (torch.float32, 1e4, 4.0), "bfloat16_3e4": (torch.bfloat16, 3e4, 600.0),
            "bfloat16_200": (torch.bfloat16, 200.0, 6.0)}
CE_ROWS, CE_VOCAB = 8, 64


def ce_inputs(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [2, 4, V] in the case's dtype and labels [2, 4] with one ignored."""
    dtype, magnitude, spread = CE_CASES[case]
    g = torch.Generator().manual_seed(11)
    centers = magnitude * torch.tensor([1.0, -1.0]).repeat(CE_ROWS // 2)[:, None]  # [N, 1]
    logits = centers + spread * torch.randn(CE_ROWS, CE_VOCAB, generator=g, dtype=torch.float64)
    labels = torch.randint(0, CE_VOCAB, (CE_ROWS,), generator=g)
    labels[3] = -100
    return logits.to(dtype).view(2, CE_ROWS // 2, CE_VOCAB), labels.view(2, CE_ROWS // 2)


def ce_reference(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Loss, gradient, softmax and shifted logits in float64 from the very same (rounded) logits."""
    x = logits.double().flatten(0, 1).requires_grad_()
    loss = F.cross_entropy(x, labels.flatten(), ignore_index=-100)
    loss.backward()
    shifted = x.detach() - x.detach().amax(-1, keepdim=True)
    return {"loss": loss.detach(), "grad": x.grad.view(logits.shape), "probs": shifted.softmax(-1),
            "shifted": shifted}


def ce_tolerances(ref: dict[str, torch.Tensor], labels: torch.Tensor, dtype: torch.dtype) -> tuple[float, torch.Tensor]:
    """(loss, gradient) bounds of a float32 cross entropy on shifted logits s = x - max (s <= 0).

    Each exp(s_j) is off by (|s_j| + 1) u relatively (s_j rounded, then exp), and exp(s)|s| <= 1/e, so the
    sum of V of them (>= 1) is off by V (1 + 1/e) u relatively, as is its log absolutely, plus u log V.
    Loss per row log(sum) - s_t: the shifted target s_t (|s_t| <= the row's loss) and the difference each
    round once. The mean over N rows: a sum of N terms and a division. So, with L the mean loss:
        loss: u (V (1 + 1/e) + log V + (N + 2) L).
    Gradient (p - onehot) / n: p = exp(s) / sum is off by (|s| + 2 + V (1 + 1/e)) u relatively; p - 1
    rounds once (u), the row scale 1/n twice (2 u |g|), and the result is returned in the logits' dtype
    (u_in |g|).
    """
    u, (n_rows, vocab) = unit_roundoff(torch.float32), ref["probs"].shape
    n_valid = (labels != -100).sum().item()
    loss_tol = u * (vocab * (1 + 1 / math.e) + math.log(vocab) + (n_rows + 2) * ref["loss"].abs().item())
    valid = (labels.flatten() != -100).double()[:, None]
    probs = ref["probs"] * (vocab * (1 + 1 / math.e) + 2 + ref["shifted"].abs())
    grad = ref["grad"].flatten(0, 1).abs()
    grad_tol = u * (probs + 1) * valid / n_valid + (2 * u + unit_roundoff(dtype)) * grad
    return loss_tol, grad_tol.view(ref["grad"].shape)


def check_cross_entropy(case: str, loss: torch.Tensor, grad: torch.Tensor) -> None:
    logits, labels = ce_inputs(case)
    ref = ce_reference(logits, labels)
    loss_tol, grad_tol = ce_tolerances(ref, labels, logits.dtype)
    loss_ratio = worst_ratio(loss, ref["loss"], loss_tol)
    grad_ratio = worst_ratio(grad, ref["grad"], grad_tol)
    assert loss_ratio <= 1 and grad_ratio <= 1, f"{case}: loss {loss_ratio:.3g}, grad {grad_ratio:.3g} x tolerance"


@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy_of_huge_logits_matches_float64(case):
    logits, labels = ce_inputs(case)
    x = logits.clone().requires_grad_()
    loss = TokenIO().cross_entropy(x, labels)
    loss.backward()
    check_cross_entropy(case, loss, x.grad)
    # The slip: the same sums without the max shift overflow (or underflow to log 0).
    wide = logits.float().flatten(0, 1)
    assert not torch.isfinite(wide.exp().sum(-1).log()).all()


@pytest.mark.parametrize("case", list(CE_CASES))
def test_vocabulary_parallel_cross_entropy_of_huge_logits_matches_float64(ranks, case):
    """tp = 2: each rank's half of the vocabulary; the gradient reassembled from both halves."""
    by_tp_rank = {r["tp"]["rank"]: r["tp"]["ce"][case] for r in ranks}
    loss = by_tp_rank[0][0]
    assert by_tp_rank[1][0] == loss  # both halves agree on the loss
    check_cross_entropy(case, loss, torch.cat([by_tp_rank[0][1], by_tp_rank[1][1]], dim=-1))


def tp_cross_entropy_on_rank() -> dict:
    group = init_mesh(Layout(tp=2, dp=WORLD // 2))["tp"]
    io, results = TensorParallelIO(group, sp=False), {}
    for case in CE_CASES:
        logits, labels = ce_inputs(case)
        width = CE_VOCAB // group.size
        shard = logits[..., group.rank * width:(group.rank + 1) * width].clone().requires_grad_()
        loss = io.cross_entropy(shard, labels)
        loss.backward()
        results[case] = (loss.detach().double(), shard.grad.double())
    return {"rank": group.rank, "ce": results}


# ---- 3. ring and USP attention at cp 8, bfloat16 inputs ----------------------------------------------------
CP, SEQ, BATCH, HEADS, HEAD_DIM = 8, 16, 2, 2, 8
SCALE = HEAD_DIM**-0.5


def attention_inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient [B, S, H, D] in bfloat16 (the float64 reference takes the same values)."""
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g, dtype=torch.float64).bfloat16()
                 for _ in range(4))


def attention_reference() -> dict[str, torch.Tensor]:
    """Causal attention on one device in float64, its gradients written out (the flash-attention backward),
    and per cp rank's queries their share of dk and dv. Heads first: [B, H, S, D]; lse [B, H, S]."""
    q, k, v, do = (t.double().transpose(1, 2) for t in attention_inputs())
    visible = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse[..., None]).exp()
    out = probs @ v
    dp = do @ v.transpose(-1, -2)
    delta = (do * out).sum(-1, keepdim=True)
    ds = probs * (dp - delta)
    ref = {"q": q, "k": k, "v": v, "do": do, "visible": visible, "scores": scores, "lse": lse, "probs": probs,
           "out": out, "dq": SCALE * ds @ k, "dk": SCALE * ds.transpose(-1, -2) @ q,
           "dv": probs.transpose(-1, -2) @ do}
    rows = [head_tail_indices(SEQ, CP, r) for r in range(CP)]
    ref["dk_shares"] = sum((SCALE * ds[..., r, :].transpose(-1, -2) @ q[..., r, :]).abs() for r in rows)
    ref["dv_shares"] = sum((probs[..., r, :].transpose(-1, -2) @ do[..., r, :]).abs() for r in rows)
    return ref


def float32_softmax_error(ref: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, H, S, 1]: a bound on the relative error of every probability of a query row computed in float32.

    A score is a dot product of D bfloat16 pairs (exact products, D - 1 additions) times the scale: off by
    (D + 1) u a, a = scale * sum|q_d k_d|, which moves a probability by twice that relatively. exp(s - lse)
    also rounds s - lse and lse (u |s - lse|, u |lse|); the row's sum of S exponentials, the log, exp and
    division round (S + 4) u; each of the cp merges rescales the running output and lse (4 u per merge).
    """
    u = unit_roundoff(torch.float32)
    abs_scores = SCALE * ref["q"].abs() @ ref["k"].abs().transpose(-1, -2)  # a
    spread = (ref["scores"] - ref["lse"][..., None]).abs().masked_fill(~ref["visible"], 0)
    per_row = 2 * (HEAD_DIM + 1) * abs_scores.masked_fill(~ref["visible"], 0).amax(-1) + spread.amax(-1)
    return u * (per_row + ref["lse"].abs() + SEQ + 4 + 4 * CP)[..., None]


def attention_tolerances(ref: dict[str, torch.Tensor], impl: str = "reference") -> dict[str, torch.Tensor]:
    """Bounds for out and lse (forward), dq, dk, dv (backward) of attention in float32 on bfloat16 inputs.

    out: the float32 result (each probability off by eps relatively, the weighted sum of S values by S u32)
    rounded once to bfloat16: ub |out| + (eps + S u32) sum_j p_j |v_j|. lse stays float32: eps.
    Backward (flash form ds = p (do.v - delta), delta = do.out): delta is formed from the saved bfloat16
    output, so it is off by ub sum|do out|, which reaches dq and dk through scale * p * |k| (or |q|); the
    float32 part of each gradient is bounded like out's, with D + 2 more roundings for do.v - delta and
    S + cp for the sums over keys and over the cp blocks. dq accumulates in float32 and is rounded once
    (ub |dq|). dk and dv accumulate in bfloat16 on their way around the ring, one term per cp rank's queries
    (docs/context_parallel.md, Limits): gamma_cp(bf16) * sum over cp ranks of |that rank's share|.

    impl "fused": each kernel call hands back its output and gradients in bfloat16, rounded once before they
    are merged or summed. A block's output is a weighted mean of its values, and the merge weights of the
    blocks add up to the whole row's probabilities, so the roundings add at most ub p|v| to out; likewise
    ub scale |ds||k| to dq; dk and dv gain one rounding per share (gamma_cp+1).
    """
    ub, u = unit_roundoff(torch.bfloat16), unit_roundoff(torch.float32)
    p, q, k, v, do = ref["probs"], ref["q"], ref["k"], ref["v"], ref["do"]
    eps = float32_softmax_error(ref)  # [B, H, S, 1]
    sums = u * (SEQ + CP + HEAD_DIM + 3)
    delta_abs = (do * ref["out"]).abs().sum(-1, keepdim=True)  # [B, H, S, 1]
    ds_abs = p * (do.abs() @ v.abs().transpose(-1, -2) + delta_abs)  # |ds| before cancellation
    out = ub * ref["out"].abs() + (1 + ub) * (eps + SEQ * u) * (p @ v.abs())
    dq = ub * ref["dq"].abs() + (1 + ub) * SCALE * (
        ub * delta_abs * (p @ k.abs()) + ((eps + sums) * ds_abs) @ k.abs())
    dk = gamma(CP, torch.bfloat16) * ref["dk_shares"] + (1 + ub) * SCALE * (
        p.transpose(-1, -2) @ (ub * delta_abs * q.abs()) + ((eps + sums) * ds_abs).transpose(-1, -2) @ q.abs())
    dv = gamma(CP, torch.bfloat16) * ref["dv_shares"] + (1 + ub) * ((eps + sums) * p).transpose(-1, -2) @ do.abs()
    if impl == "fused":
        out = out + (1 + ub) ** 2 * ub * (p @ v.abs())
        dq = dq + (1 + ub) ** 2 * ub * SCALE * ds_abs @ k.abs()
        dk = dk + (gamma(CP + 1, torch.bfloat16) - gamma(CP, torch.bfloat16)) * ref["dk_shares"]
        dv = dv + (gamma(CP + 1, torch.bfloat16) - gamma(CP, torch.bfloat16)) * ref["dv_shares"]
    return {"out": out, "lse": eps[..., 0], "dq": dq, "dk": dk, "dv": dv}


def merged_in(running_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the whole sequence merged from cp key blocks on one process, the running output and lse
    kept in `running_dtype`: (out [B, S, H, D] in bfloat16, lse [B, H, S])."""
    q, k, v, _ = attention_inputs()
    positions = torch.arange(SEQ)
    out = torch.zeros(q.shape, dtype=running_dtype)
    lse = torch.full((BATCH, HEADS, SEQ), float("-inf"), dtype=running_dtype)
    for cols in positions.chunk(CP):
        block_out, block_lse = block_forward(q, k[:, cols], v[:, cols], positions, cols, True, SCALE)
        merge(out, lse, block_out, block_lse)
    return out.bfloat16(), lse


def test_merging_cp_blocks_needs_a_float32_running_output_and_lse():
    """The merge alone, on one process: kept in float32 it is within the bound; kept in bfloat16 it is not."""
    ref = attention_reference()
    tol = attention_tolerances(ref)
    out, lse = merged_in(torch.float32)
    assert worst_ratio(out.transpose(1, 2), ref["out"], tol["out"]) <= 1
    assert worst_ratio(lse, ref["lse"], tol["lse"]) <= 1
    out, lse = merged_in(torch.bfloat16)
    assert worst_ratio(out.transpose(1, 2), ref["out"], tol["out"]) > 1
    assert worst_ratio(lse, ref["lse"], tol["lse"]) > 1


def cp_attention_on_rank() -> dict:
    mesh = init_mesh(Layout(cp=CP))
    results = {}
    for mode, degree, impl in (("ring", None, "reference"), ("usp", 2, "reference"), ("ring", None, "fused"),
                               ("usp", 2, "fused")):
        q, k, v, do = (context.shard(t, mesh) for t in attention_inputs())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = context.attention(q, k, v, mesh, mode=mode, causal=True, ulysses_degree=degree, impl=impl)
        out.backward(do)
        results[mode, impl] = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        assert all(t.dtype == torch.bfloat16 for t in results[mode, impl].values())
        if mode == "ring":
            q, k, v, _ = (context.shard(t, mesh) for t in attention_inputs())
            _, results[mode, impl]["lse"] = ring.attention(q, k, v, mesh["cp"], True, SCALE, impl)
    return {key: {name: t.detach().double() for name, t in parts.items()} for key, parts in results.items()}


def whole(shards: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """The full sequence from every cp rank's head-tail shard."""
    full = torch.empty(*shards[0].shape[:seq_dim], SEQ, *shards[0].shape[seq_dim + 1:], dtype=shards[0].dtype)
    for rank, part in enumerate(shards):
        full.index_copy_(seq_dim, head_tail_indices(SEQ, CP, rank), part)
    return full


@pytest.mark.parametrize("impl", ["reference", "fused"])
@pytest.mark.parametrize("mode", ["ring", "usp"])
def test_context_parallel_attention_in_bfloat16_within_the_float32_merge_bound(ranks, mode, impl):
    """cp = 8 (USP: Ulysses 2 x ring 4); out, dq, dk, dv (and ring's float32 lse) against float64, with the
    matmul blocks and with the fused kernel's blocks (each rounded to bfloat16 before its merge)."""
    ref = attention_reference()
    tol = attention_tolerances(ref, impl)
    names = ["out", "dq", "dk", "dv"] + (["lse"] if mode == "ring" else [])
    ratios = {}
    for name in names:
        got = whole([r["cp"][mode, impl][name] for r in ranks], seq_dim=2 if name == "lse" else 1)
        ratios[name] = worst_ratio(got if name == "lse" else got.transpose(1, 2), ref[name], tol[name])
    assert max(ratios.values()) <= 1, f"{mode} {impl}: error / tolerance {ratios}"


# ---- 4. gradient reduction over dp 8 with bfloat16 parameters ---------------------------------------------
DP_CFG = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, ffn_dim=20)
DP_STAGES = {"ddp": {}, "ddp_buckets": dict(grad_bucket_numel=300), "zero2": dict(zero_stage=2),
             "zero3": dict(zero_stage=3)}
DP_REDUCE = ("bfloat16", "float32")


def dp_rows(rank: int) -> torch.Tensor:
    """This dp rank's 2 sequences of 9 tokens."""
    return torch.randint(0, DP_CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(40 + rank))


def token_loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


def local_grads(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's own bfloat16 gradients from a plain bf16 copy of the model: what each rank hands in."""
    master = Transformer(DP_CFG, seed=0, dtype=torch.float32)
    model = Transformer(DP_CFG, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        for p, m in zip(model.parameters(), master.parameters(), strict=True):
            p.copy_(m)
    token_loss(model(rows[:, :-1]), rows).backward()
    return {name: p.grad.double() for name, p in model.named_parameters()}


def dp_reduction_on_rank() -> dict:
    mesh = init_mesh(Layout(dp=WORLD))
    rows = dp_rows(mesh["dp"].rank)
    results = {"local": local_grads(rows)}
    for stage, options in DP_STAGES.items():
        for reduce_dtype in DP_REDUCE:
            config = ParallelConfig(param_dtype="bfloat16", reduce_dtype=reduce_dtype, **options)
            dp = DataParallel(Transformer(DP_CFG, seed=0, dtype=torch.float32), mesh, config)
            token_loss(dp(rows[:, :-1]), rows).backward()
            if stage == "ddp":  # the premise: the wrapped model computes the plain copy's gradients, bitwise
                results["wrapped"] = {name: p.grad.double() for name, p in dp.module.named_parameters()}
            dp.reduce_gradients()
            results[stage, reduce_dtype] = {name: g.double() for name, g in dp.full_grads().items()}
    return results


@pytest.mark.parametrize("reduce_dtype", DP_REDUCE)
@pytest.mark.parametrize("stage", list(DP_STAGES))
def test_gradient_reduction_over_8_ranks_within_the_summation_bound(ranks, stage, reduce_dtype):
    """The averaged gradient times 8 against the float64 sum of the 8 ranks' bfloat16 gradients.

    Each rank's gradient enters the reduction exactly (a bf16 value, in a bf16 or fp32 wire), and 8 terms
    take 7 additions in the reduce dtype: |error| <= gamma(7) * sum_r |g_r|. The division by 8 and the
    copies into the fp32 main gradients are exact.
    """
    dp = [r["dp"] for r in ranks]
    assert all(torch.equal(r["wrapped"][n], r["local"][n]) for r in dp for n in r["local"])
    bound = gamma(WORLD - 1, getattr(torch, reduce_dtype))
    ratios = {}
    for name in dp[0]["local"]:
        total = sum(r["local"][name] for r in dp)
        magnitude = sum(r["local"][name].abs() for r in dp)
        got = dp[0][stage, reduce_dtype][name] * WORLD
        assert all(torch.equal(r[stage, reduce_dtype][name], dp[0][stage, reduce_dtype][name]) for r in dp)
        ratios[name] = worst_ratio(got, total, bound * magnitude)
    assert max(ratios.values()) <= 1, f"{stage} reduced in {reduce_dtype}: error / tolerance {ratios}"


# ---- the one launch of 8 ranks -------------------------------------------------------------------------------


def on_every_rank() -> dict:
    return {"cp": cp_attention_on_rank(), "dp": dp_reduction_on_rank(), "tp": tp_cross_entropy_on_rank()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    # Seconds of work on idle cores; the limit only catches a hang, and eight ranks starting on two busy
    # cores have taken over the default 120 s.
    return run_distributed(on_every_rank, WORLD, timeout=600)


# ---- 5. MoE routing in bfloat16 --------------------------------------------------------------------------
ROUTER_CFG = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=32, ffn_dim=32, n_experts=16,
                         top_k=2, moe_ffn_dim=16)
ROUTED_TOKENS = 4096


def bf16_router() -> tuple[Router, torch.Tensor]:
    """A bfloat16 router with logits of about unit size, and its tokens [T, dim] in bfloat16."""
    g = torch.Generator().manual_seed(3)
    router = Router(ROUTER_CFG).to(torch.bfloat16)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(router.gate.weight.shape, generator=g) / ROUTER_CFG.dim**0.5)
    return router, torch.randn(ROUTED_TOKENS, ROUTER_CFG.dim, generator=g).bfloat16()


def logit_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, E]: float32 logits of bfloat16 x and weight: exact products, dim - 1 additions in any order."""
    return gamma(x.shape[-1] - 1, torch.float32) * (x.double().abs() @ weight.double().abs().t())


def boundary_gap(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T]: the float64 logit gap between each token's k-th and (k+1)-th expert."""
    top = logits.topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def flip_margin(logits64: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[T]: how close two experts' float64 logits must be for float32 routing to order them otherwise.

    Each logit is off by at most its bound; the float32 softmax of the logits rounds l - max (u |l - max|),
    exp and the division (2 u more), which moves a score as a logit shift of that size would. Two experts can
    swap only within the sum of both shifts.
    """
    u = unit_roundoff(torch.float32)
    shift = bound + u * ((logits64 - logits64.amax(-1, keepdim=True)).abs() + 3)
    return 2 * shift.amax(-1)


def other_experts(topk_idx: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[T] bool: tokens whose set of experts differs (the order within the top k aside)."""
    return (topk_idx.sort(-1).values != reference.sort(-1).values).any(-1)


def test_router_logits_are_float32_and_routing_moves_only_at_true_near_ties():
    """Logits within the float32 bound of float64; a token routes unlike float64 only where its k-th and
    (k+1)-th experts lie within the flip margin; the same holds between layouts (the tokens routed as one
    batch, or as shards of 1, 7 and 512 tokens, as ranks would), and the margin is narrow enough that
    logits rounded to bfloat16 break it."""
    router, x = bf16_router()
    weight = router.gate.weight
    logits, scores, topk_idx, _ = router.route(x)
    logits64 = x.double() @ weight.double().t()
    bound = logit_bound(x, weight)
    assert logits.dtype == scores.dtype == torch.float32
    assert worst_ratio(logits, logits64, bound) <= 1
    k, margin, gap = ROUTER_CFG.top_k, flip_margin(logits64, bound), boundary_gap(logits64, ROUTER_CFG.top_k)
    want = choose_experts(logits64.softmax(-1), k)
    flipped = other_experts(topk_idx, want)
    assert (gap[flipped] <= margin[flipped]).all(), f"{int(flipped.sum())} flips, gaps {gap[flipped].tolist()}"
    for shard in (1, 7, 512):
        # A token routed otherwise in two layouts is routed unlike float64 in one of them: within the margin.
        moved = other_experts(torch.cat([router.route(part)[2] for part in x.split(shard)]), topk_idx)
        assert (gap[moved] <= margin[moved]).all(), f"shards of {shard}: {int(moved.sum())} tokens moved"
    # The slip: logits rounded to bfloat16 (a bf16 gate) flip tokens whose experts are far from a tie.
    slipped = other_experts(choose_experts(logits64.bfloat16().float().softmax(-1), k), want)
    assert (gap[slipped] > margin[slipped]).any()


def test_equal_scores_go_to_the_lower_expert_id():
    """Ties break by a rule, not by the kernel: the lower expert id wins, in any batch."""
    router, _ = bf16_router()
    zeros = torch.zeros(5, ROUTER_CFG.dim, dtype=torch.bfloat16)  # every expert scores alike
    assert router.route(zeros)[2].tolist() == [[0, 1]] * 5
    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.5, 0.2, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    assert choose_experts(scores, 2).tolist() == [[1, 2], [0, 2], [0, 1]]
    grouped = torch.tensor([[0.2, 0.2, 0.9, 0.1, 0.9, 0.1, 0.3, 0.3]])  # groups of 2: [0.2, 0.9, 0.9, 0.3]
    assert choose_experts(grouped, 2, n_groups=4, topk_groups=1).tolist() == [[2, 3]]
