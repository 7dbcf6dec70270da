"""`train()` redone on one device with plain torch: the independent reference for trainer-level tests.

The unwrapped `Transformer`, `torch.optim.AdamW` (betas (0.9, 0.95), eps 1e-8, weight decay on matrices
only), `torch.nn.utils.clip_grad_norm_` and the trainer's schedule `lr_at`, on the batches the trainer's
data pipeline yields. Packed samples ([B, S + 1, 2] token and document id pairs) are masked here in plain torch:
labels across a boundary ignored, positions restarting per document, and every layer's attention core replaced
by one that applies the explicit dense block-diagonal causal mask. Routers' balancing biases move by DeepSeek-V3's
rule, written out here, from the loads of the training forwards only (evaluation routes without counting). Nothing
from `orangetron.parallel` takes part, so a bug there cannot hide in both. A run's own numbers come from what it
writes with `out=` and `save_every=`: the per-step gradient norm in metrics.jsonl and the final parameters, AdamW
moments and buffers in its last checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from orangetron.model import Transformer
from orangetron.model.documents import Documents
from orangetron.model.moe import Router
from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
from orangetron.train.config import TrainConfig
from orangetron.train.schedule import lr_at
from orangetron.train.step import IGNORE_INDEX
from orangetron.train.trainer import load_data

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the trainer: fp32 or wider
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def _adamw(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


class DenseDocumentAttention(torch.nn.Module):
    """Attention of q [B, S, Hq, D] over k, v [B, S, Hk, D] under the explicit mask "key j visible to query i iff
    j <= i and both carry the same document id", built from the ids alone; plain causal without documents."""

    def forward(self, q, k, v, documents=None):
        s, group = q.shape[1], q.shape[2] // k.shape[2]
        visible = torch.ones(s, s, dtype=torch.bool).tril().expand(q.shape[0], s, s)
        if documents is not None:
            visible = visible & (documents.ids.unsqueeze(2) == documents.ids.unsqueeze(1))  # [B, S, S]
        kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
        scores = q.transpose(1, 2) @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5  # [B, H, S, S]
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        return (scores.softmax(-1) @ vh).transpose(1, 2)


def _model_inputs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(inputs, labels, the model's keyword arguments) of rows [B, S + 1], or packed [B, S + 1, 2]."""
    if rows.dim() == 2:
        return rows[:, :-1], rows[:, 1:], {}
    tokens, ids = rows[..., 0], rows[..., 1]
    labels = torch.where(ids[:, 1:] == ids[:, :-1], tokens[:, 1:], IGNORE_INDEX)
    ids = ids[:, :-1]
    index = torch.arange(ids.shape[1]).expand_as(ids)
    starts = torch.where(torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] != ids[:, :-1]], 1),
                         index, 0).cummax(dim=1).values  # each token's document start
    return tokens[:, :-1], labels, {"position_ids": index - starts, "documents": Documents.from_ids(ids)}


@torch.no_grad()
def _eval_loss(model: Transformer, samples: torch.Tensor, cfg: TrainConfig) -> float | None:
    n = min(samples.shape[0], cfg.batch_size * cfg.eval_batches)
    if n == 0:
        return None
    total = 0.0
    for rows in samples[:n].split(cfg.batch_size):
        inputs, labels, kwargs = _model_inputs(rows)
        total += _cross_entropy(model(inputs, **kwargs), labels).item() * rows.shape[0]
    return total / n


def reference_training(cfg: TrainConfig) -> dict[str, Any]:
    """losses and gradient norms (before clipping) per step, eval_loss, and the final params, exp_avg and
    exp_avg_sq by parameter name, for `cfg` trained on one device (float32 or float64)."""
    data = load_data(cfg)
    model = Transformer(cfg.model_config(), seed=cfg.seed, dtype=DTYPES[cfg.param_dtype])
    if cfg.hf_model is not None:  # the run starts from a Hugging Face folder's weights (tests/test_hf.py checks them)
        from orangetron.hf import load

        model = load(cfg.hf_model, dtype=DTYPES[cfg.param_dtype])
    if cfg.pack_documents:
        for layer in model.layers:
            layer.attention.core_attention = DenseDocumentAttention()
    opt = _adamw(model, cfg)
    loads = _training_loads(model)
    losses, grad_norms = [], []
    for step, rows in zip(range(cfg.steps), data.train, strict=False):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, labels, kwargs = _model_inputs(rows)
        lm_loss = _cross_entropy(model(inputs, token_mask=labels != IGNORE_INDEX, **kwargs), labels)
        (lm_loss + model.aux_loss()).backward()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False).item())
        opt.step()
        _move_biases(loads)
        opt.zero_grad()
        losses.append(lm_loss.item())
    named = dict(model.named_parameters())
    return {"losses": losses, "grad_norms": grad_norms, "eval_loss": _eval_loss(model, data.eval_samples, cfg),
            "params": {n: p.detach().clone() for n, p in named.items()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "exp_avg": {n: opt.state[p]["exp_avg"] for n, p in named.items()},
            "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"] for n, p in named.items()}}


def _training_loads(model: Transformer) -> dict[Router, torch.Tensor]:
    """Per biased router, the expert assignments of non-padding tokens in forwards with gradients, counted from
    the top-k ids the router returns (a forward hook), not from its own counter."""
    loads = {}
    for router in (m for m in model.modules() if isinstance(m, Router) and m.expert_bias is not None):
        loads[router] = torch.zeros(router.n_experts, dtype=torch.float64)

        def count(module, inputs, outputs):
            if torch.is_grad_enabled():
                ids = outputs[0] if len(inputs) < 2 or inputs[1] is None else outputs[0][inputs[1]]
                loads[module] += torch.bincount(ids.flatten(), minlength=module.n_experts)
        router.register_forward_hook(count)
    return loads


@torch.no_grad()
def _move_biases(loads: dict[Router, torch.Tensor]) -> None:
    """Each bias up by the router's rate where its expert's load is below the mean, down where above."""
    for router, load in loads.items():
        router.expert_bias += router.bias_rate * torch.sign(load.mean() - load).to(router.expert_bias.dtype)
        load.zero_()


def written_run(out: str | Path) -> dict[str, Any]:
    """grad_norms and the last held-out loss from a run folder's metrics.jsonl, and params, exp_avg, exp_avg_sq
    from its last checkpoint."""
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    state = load_checkpoint(latest_checkpoint(Path(out) / "checkpoints"))
    return {"grad_norms": [r["grad_norm"] for r in records], "eval_loss": records[-1].get("eval_loss"),
            **{key: state[key] for key in ("params", "exp_avg", "exp_avg_sq")}, "buffers": state.get("buffers", {})}


def assert_matches_reference(result: dict[str, Any], out: str | Path, reference: dict[str, Any], rtol: float) -> None:
    """Losses, eval loss, every step's gradient norm, the final parameters and moments of each tensor, and the
    routers' balancing biases."""
    written = written_run(out)
    torch.testing.assert_close(result["losses"], reference["losses"], rtol=rtol, atol=0, msg="losses")
    torch.testing.assert_close(result["eval_loss"], reference["eval_loss"], rtol=rtol, atol=0, msg="eval loss")
    # as metrics.jsonl logs it: a context-parallel rank's share was written there once
    torch.testing.assert_close(written["eval_loss"], reference["eval_loss"], rtol=rtol, atol=0, msg="logged eval")
    torch.testing.assert_close(written["grad_norms"], reference["grad_norms"], rtol=rtol, atol=0, msg="grad norms")
    biases = {n: b for n, b in reference["buffers"].items() if n.endswith("expert_bias")}
    assert written["buffers"].keys() == biases.keys(), "buffers"
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert written[key].keys() == reference[key].keys(), key
        for name, value in reference[key].items():
            scale = value.abs().max().item()
            torch.testing.assert_close(written[key][name], value, rtol=rtol, atol=rtol * scale, msg=f"{key} {name}")
    for name, bias in biases.items():  # multiples of the rate: equal, not close
        torch.testing.assert_close(written["buffers"][name], bias, rtol=0, atol=1e-12, msg=f"buffer {name}")
