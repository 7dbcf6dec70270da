"""`orangetron verify`: the same steps on one rank and on a layout; the largest loss and gradient gaps.

Both runs start from the same seed, see the same batches and take the same AdamW steps. Gradients are read
after they are averaged over the data-parallel ranks and before clipping, on every step, and compared with
the one-rank gradients as max|g - g_ref| / max|g_ref|. The MoE load-balancing loss is switched off in both
runs: each rank balances its own tokens, so that term differs between layouts by definition.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from orangetron.parallel import DataParallel
from orangetron.train.launch import launch_local, process_group
from orangetron.train.trainer import TrainConfig, _setup, _train_step, lr_at

DEFAULT_TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 2e-2}


def _trace(cfg: TrainConfig) -> dict[str, Any]:
    """This rank's losses and the gradient slice it owns after averaging, step by step."""
    setup = _setup(cfg)
    grads: list[torch.Tensor] = []

    def keep(dp: DataParallel) -> None:
        grads.append(dp.owned_grads().detach().double().clone())

    losses, batches = [], iter(setup.data.train)
    for step in range(cfg.steps):
        rows = setup.rows(next(batches))
        loss, _, _ = _train_step(setup.dp, setup.optimizer, rows, lr_at(step, cfg), cfg.grad_clip,
                                 measure=False, on_grads=keep)
        setup.optimizer.zero_grad()
        losses.append(loss)
    dp = setup.dp
    return {"losses": losses, "grads": grads, "start": dp.owned.start, "numel": dp.numel,
            "sharded": dp.shards > 1, "dp_cp_rank": dp.group.rank}


def _full_grads(traces: list[dict[str, Any]], step: int) -> torch.Tensor:
    """The whole gradient vector of `step`, from the slices the dp x cp ranks own (or any full copy)."""
    first = traces[0]
    if not first["sharded"]:
        return first["grads"][step]
    owners = {t["dp_cp_rank"]: t for t in traces}  # tensor-parallel peers hold the same slice
    flat = torch.cat([owners[r]["grads"][step] for r in sorted(owners)])
    return flat[: first["numel"]]


def _relative_gap(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().item() or 1.0
    return (value - reference).abs().max().item() / scale


def verify(cfg: TrainConfig, tolerance: float | None = None) -> dict[str, Any]:
    """Run `cfg` on one rank and on its layout; return the `verify --json` object."""
    model = dataclasses.replace(cfg.model_config(), aux_loss_coef=0.0)
    layout_cfg = dataclasses.replace(cfg, model=model)
    one_cfg = dataclasses.replace(layout_cfg, dp=1, zero_stage=0, distributed_optimizer=False)
    with process_group():
        reference = _trace(one_cfg)
    traces = launch_local(_trace, cfg.layout.world_size, args=(layout_cfg,))
    dp = cfg.layout.dp
    loss_gaps, grad_gaps = [], []
    for step, ref_loss in enumerate(reference["losses"]):
        loss = sum(t["losses"][step] for t in traces[:: cfg.layout.tp][:dp]) / dp  # equal shares
        loss_gaps.append(abs(loss - ref_loss) / abs(ref_loss))
        grad_gaps.append(_relative_gap(_full_grads(traces, step), reference["grads"][step]))
    tolerance = DEFAULT_TOLERANCE[cfg.dtype] if tolerance is None else tolerance
    result = {"layout": cfg.layout.degrees(), "steps": cfg.steps, "dtype": cfg.dtype,
              "max_loss_rel_diff": max(loss_gaps), "max_grad_rel_diff": max(grad_gaps), "tolerance": tolerance}
    result["ok"] = result["max_loss_rel_diff"] <= tolerance and result["max_grad_rel_diff"] <= tolerance
    return result
