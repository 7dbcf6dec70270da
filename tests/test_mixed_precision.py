"""Every data-parallel stage on dp = 2 and 4, by value: float32 against the plain one-device model, and
bfloat16 against a one-device emulation of bf16 weights with fp32 master copies. Losses, the averaged
gradients of every step, the final model parameters and the final fp32 masters are all compared."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import DataParallel, ParallelConfig
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

# Dense on purpose: in bf16 a router's top-k can flip between one device and d ranks, which would turn a
# rounding-sized difference into a different expert; routing exactness is the float64 tests' job.
CFG = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, ffn_dim=20)
# Rows x SEQ tokens are powers of two on every rank and on one device, so a mean's 1/N is exact in bf16.
SEQ, ROWS, STEPS, LR, CLIP, WD = 8, 4, 4, 1e-2, 1.0, 0.1
STAGES = {"ddp": dict(zero_stage=0), "ddp_buckets": dict(grad_bucket_numel=300), "zero1": dict(zero_stage=1),
          "distopt": dict(distributed_optimizer=True), "zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
          "zero1_buckets": dict(zero_stage=1, grad_bucket_numel=300),
          "zero2_buckets": dict(zero_stage=2, grad_bucket_numel=300)}
# (param_dtype, reduce_dtype): bf16 weights reduced in fp32 for the close comparison, and in bf16 (the
# default, as docs/data_parallel.md's tables) for the loose one.
PRECISIONS = {"fp32": ("float32", None), "bf16": ("bfloat16", "float32"), "bf16_wire": ("bfloat16", None)}


def batch(step: int) -> torch.Tensor:
    """Counting sequences from random starts: learnable in a few steps, so the loss visibly falls."""
    g = torch.Generator().manual_seed(100 + step)
    starts = torch.randint(0, CFG.vocab_size, (ROWS, 1), generator=g)
    return (starts + torch.arange(SEQ + 1)) % CFG.vocab_size  # [ROWS, SEQ + 1]


def ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), foreach=False)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


# ---- the one-device references --------------------------------------------------------------------


def reference_fp32() -> dict[str, list | torch.Tensor]:
    """The plain model on the whole batch with torch.optim.AdamW and torch's clipping."""
    model = Transformer(CFG, seed=0, dtype=torch.float32)
    opt = adamw(list(model.parameters()))
    losses, grads = [], []
    for step in range(STEPS):
        tokens = batch(step)
        loss = ce(model(tokens[:, :-1]), tokens)
        loss.backward()
        grads.append(flat(p.grad for p in model.parameters()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = flat(model.parameters())
    return {"losses": losses, "grads": grads, "params": params, "main_params": params}


def reference_bf16() -> dict[str, list | torch.Tensor]:
    """bf16 weights computing forward and backward, fp32 masters taking the AdamW step, on one device.

    After every step the bf16 weights are the masters rounded to bf16; gradients reach the optimizer
    as fp32 copies of the bf16 gradients.
    """
    master = Transformer(CFG, seed=0, dtype=torch.float32)
    model = Transformer(CFG, seed=0, dtype=torch.bfloat16)
    pairs = list(zip(master.parameters(), model.parameters(), strict=True))
    opt = adamw(list(master.parameters()))
    losses, grads = [], []
    with torch.no_grad():
        for m, p in pairs:
            p.copy_(m)
    for step in range(STEPS):
        tokens = batch(step)
        loss = ce(model(tokens[:, :-1]), tokens)
        loss.backward()
        for m, p in pairs:
            m.grad, p.grad = p.grad.float(), None
        grads.append(flat(m.grad for m, _ in pairs))
        torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP, foreach=False)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in pairs:
                p.copy_(m)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": flat(model.parameters()),
            "main_params": flat(master.parameters())}


# ---- the data-parallel runs ------------------------------------------------------------------------


def dp_run(mesh, stage: str, precision: str) -> dict[str, list | torch.Tensor]:
    """STEPS steps of one stage; returns this rank's losses and the whole averaged grads and params."""
    param_dtype, reduce_dtype = PRECISIONS[precision]
    config = ParallelConfig(param_dtype=param_dtype, reduce_dtype=reduce_dtype, **STAGES[stage])
    dp = DataParallel(Transformer(CFG, seed=0, dtype=torch.float32), mesh, config)
    opt = dp.optimizer(lr=LR, betas=(0.9, 0.95), weight_decay=WD)
    g = dp.group
    share = ROWS // g.size
    losses, grads = [], []
    for step in range(STEPS):
        rows = batch(step)[g.rank * share:(g.rank + 1) * share]
        loss = ce(dp(rows[:, :-1]), rows)
        loss.backward()
        dp.reduce_gradients()
        grads.append(flat(dp.full_grads().values()).double())
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    main_params = flat(dp.full_state(opt)["params"].values())
    dp.gather_params()  # whole parameters to read, where the strategy shards them
    return {"losses": losses, "grads": grads, "params": flat(dp.module.parameters()), "main_params": main_params}


def every_stage_and_precision(layout: Layout) -> dict[tuple[str, str], dict]:
    mesh = init_mesh(layout)
    return {(stage, precision): dp_run(mesh, stage, precision) for precision in PRECISIONS for stage in STAGES}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda d: f"dp{d}")
def runs(request) -> dict[tuple[str, str], dict]:
    """One launch per dp degree: every stage and precision; losses averaged over the ranks."""
    d = request.param
    per_rank = run_distributed(every_stage_and_precision, d, args=(Layout(dp=d),))
    merged = {}
    for key, first in per_rank[0].items():
        losses = [sum(r[key]["losses"][s] for r in per_rank) / d for s in range(STEPS)]
        merged[key] = first | {"losses": losses}
    return merged


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {"fp32": reference_fp32(), "bf16": reference_bf16()}


def gaps(run: dict, ref: dict) -> dict[str, float]:
    """Largest loss gap (relative), the first step's gradient gap (relative to the largest gradient), the
    largest per-step gradient gap in norm, and the final parameters' gap: elementwise for float32, and in
    norm relative to how far the reference moved from the initial weights (`*_update`)."""
    first, initial = ref["grads"][0], flat(Transformer(CFG, seed=0).parameters())
    out = {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"], strict=True)),
        "first_grads": ((run["grads"][0] - first).abs().max() / first.abs().max()).item(),
        "grads_norm": max(((a - b).norm() / b.norm()).item() for a, b in zip(run["grads"], ref["grads"], strict=True)),
    }
    for key in ("params", "main_params"):
        out[key] = (run[key] - ref[key]).abs().max().item()
        out[f"{key}_update"] = ((run[key] - ref[key]).norm() / (ref[key] - initial).norm()).item()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_float32_matches_one_device(runs, references, stage) -> None:
    run, ref = runs[stage, "fp32"], references["fp32"]
    # Only the order of additions differs (a sum over ranks vs over one batch): observed gaps are ~3e-7.
    for step, (grads, ref_grads) in enumerate(zip(run["grads"], ref["grads"], strict=True)):
        torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-5 * ref_grads.abs().max().item(),
                                   msg=f"{stage} step {step} gradients")
    torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-5, atol=0, msg=f"{stage} losses")
    torch.testing.assert_close(run["params"], ref["params"], rtol=0, atol=1e-5, msg=f"{stage} params")
    assert run["losses"][-1] < run["losses"][0] - 0.1


# bf16 tolerances. Both sides compute with the same bf16 weights at step 0; they differ only where the batch
# is split: each rank's weight gradient is rounded to bf16 (8 significant bits, unit roundoff 2^-9) before
# the d partial sums are added, where one device rounds the whole sum once. That is at most about
# (d + 1) * 2^-9 ~ 1% of the largest gradient for d = 4 (observed 0.34%): FIRST_GRADS = 2^-6.
# From the first update on, the trajectories part legitimately: a master near a bf16 rounding boundary gives
# weights one bf16 step apart, and AdamW's early updates move every element by about lr whatever its
# gradient's size, so an element whose gradient is within rounding noise of zero may move the other way
# (elementwise gaps up to ~2 * lr * steps; observed 0.0098). So later steps are compared in norm: per-step
# gradients (observed <= 0.8%) and the final weights' distance from the reference relative to the
# reference's own update (observed <= 1.7%); losses observed within 9e-5. The bounds sit 2-4x above
# those and below what plain float32 training scores against the emulation (losses 3.3e-4, gradients
# 6.8%, weights 7%), so they tell bf16 weights with fp32 masters from anything else; weights that never
# take the update score 100%.
BF16 = {"loss": 2e-4, "first_grads": 2**-6, "grads_norm": 0.03, "params_update": 0.035, "main_params_update": 0.035}
# Reducing in bf16 rounds every rank's share again on the wire (one more 2^-9 per addition): a little looser.
BF16_WIRE = {"loss": 3e-4, "first_grads": 2**-5, "grads_norm": 0.04, "params_update": 0.05, "main_params_update": 0.05}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("precision", "tolerance"), [("bf16", BF16), ("bf16_wire", BF16_WIRE)], ids=["fp32_reduce",
                                                                                                      "bf16_reduce"])
def test_bfloat16_matches_master_weight_emulation(runs, references, stage, precision, tolerance) -> None:
    run = runs[stage, precision]
    measured = gaps(run, references["bf16"])
    assert all(measured[k] <= tolerance[k] for k in tolerance), (stage, precision, measured)
    assert run["losses"][-1] < run["losses"][0] - 0.1
