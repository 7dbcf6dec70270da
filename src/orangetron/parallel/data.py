"""Data parallelism over the dp x cp ranks: DDP, ZeRO-1/2/3 and Megatron's distributed optimizer.

Every parameter lives in one flat buffer, padded so that each of the d = dp * cp ranks owns an equal slice.
What each stage keeps and sends (the seed's tables, DESIGN section 5):

| stage | params | main grads | main params, optimizer | after backward | parameter sync |
|---|---|---|---|---|---|
| DDP (0) | full | full | full | all-reduce | none |
| ZeRO-1, ZeRO-2 | full | full / 1/d | 1/d | reduce-scatter | all-gather before the next forward (lazy) |
| distributed optimizer | full | full | 1/d | reduce-scatter | all-gather right after the step (eager) |
| ZeRO-3 | 1/d | 1/d | 1/d | reduce-scatter | all-gather before forward and before backward |

Gradients are averaged over the d ranks, so each rank's loss must be the mean over an equal share of the
batch. Every rank must build the model from the same seed (orangetron's initialization depends only on the
seed and the config), because the wrapper does not broadcast the initial weights.

A tensor-parallel module (one with `placements`, from `orangetron.parallel.tensor`) holds shards: its
partial gradients are summed over tp before the data-parallel reduction, the gradient norm counts every
distinct element once across tp, and `full_state` / `load_full_state` speak of whole tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import ParallelMesh
from orangetron.parallel.buckets import GradBuckets
from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.optim import FlatAdamW
from orangetron.parallel.tensor import gather_tensor, shard_tensor
from orangetron.plan.sharding import padded_numel, shard_numel


class DataParallel(nn.Module):
    """Wrap `module` for data parallelism over `mesh["dp_cp"]`; build the optimizer with `optimizer()`."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, config: ParallelConfig | None = None) -> None:
        super().__init__()
        self.module = module
        self.config = config or ParallelConfig()
        self.mesh = mesh
        self.group = mesh["dp_cp"]
        self.placements = getattr(module, "placements", None)  # by parameter name, under tensor parallelism
        self.tp = mesh["tp"] if self.placements is not None and mesh["tp"].size > 1 else None
        self.zero3 = self.config.zero_stage == 3
        self.shards = self.group.size if self.config.shards_optimizer else 1
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.numel = sum(p.numel() for _, p in self._named)
        self.shard_numel = shard_numel(self.numel, self.shards)
        self.padded_numel = padded_numel(self.numel, self.shards)
        start = self.group.rank * self.shard_numel if self.shards > 1 else 0
        self.owned = slice(start, start + self.shard_numel)  # this rank's slice of every flat buffer
        self._build_buffers()
        self._params_stale = False
        self._grads_pending = False
        bucket_numel = self.config.grad_bucket_numel
        if bucket_numel and self.tp is not None and any(p.needs_sync() for p in self.placements.values()):
            raise ParallelConfigError(
                f"grad_bucket_numel={bucket_numel} with tp={self.tp.size}: gradients summed over tp before the "
                "data-parallel reduction (sequence parallel, or kv heads fewer than tp) are not bucketed yet; use 0")
        self.buckets = GradBuckets(self, bucket_numel) if bucket_numel else None

    # ---- buffers ---------------------------------------------------------------------------------

    def _build_buffers(self) -> None:
        cfg = self.config
        self.device = next(iter(self.module.parameters())).device
        flat = torch.zeros(self.padded_numel, dtype=cfg.torch_param_dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for _, p in self._named:
                flat[offset:offset + p.numel()].copy_(p.reshape(-1))
                p.data = flat[offset:offset + p.numel()].view(p.shape)  # the module now computes on `flat`
                offset += p.numel()
        self.flat_params = flat
        self.param_shard = flat[self.owned].clone() if self.zero3 else flat[self.owned]
        main_dtype = torch.float32 if cfg.mixed_precision else cfg.torch_param_dtype
        self.main_params = self.param_shard.to(main_dtype, copy=True) if cfg.mixed_precision else self.param_shard
        if cfg.zero_stage >= 2:
            self.main_grads = torch.zeros(self.shard_numel, dtype=main_dtype, device=self.device)
        else:
            self.main_grads = torch.zeros(self.padded_numel, dtype=main_dtype, device=self.device)
        if self.zero3:
            self._release_params()

    def _release_params(self) -> None:
        # The parameters stay views of `flat_params`; only its storage goes (tensors saved for backward
        # keep referring to it and see the values again once it is re-gathered).
        self.flat_params.untyped_storage().resize_(0)

    def _gather_params(self) -> None:
        nbytes = self.padded_numel * self.flat_params.element_size()
        if self.flat_params.untyped_storage().nbytes() != nbytes:
            self.flat_params.untyped_storage().resize_(nbytes)
        # Under ZeRO-1/2 the shard is a view of the buffer being gathered into, so it travels as a copy.
        shard = self.param_shard if self.zero3 else self.param_shard.clone()
        comm.all_gather_into(self.flat_params, shard, self.group)
        self._params_stale = False

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps between steps, by memory category (see `orangetron.memory`)."""
        mixed = self.config.mixed_precision
        return {
            "params": [self.param_shard] if self.zero3 else [self.flat_params],
            "grads": [self.main_grads],
            "main_params": [self.main_params] if mixed else [],
        }

    # ---- forward and backward ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.zero3 or self._params_stale:
            self._gather_params()
        out = self.module(*args, **kwargs)
        if self.zero3:
            self._release_params()
            needs_grad = [t for t in _tensors(out) if t.requires_grad]
            if needs_grad:
                # Whichever output's gradient arrives first starts the backward: gather before any of it.
                self._gathered_for_backward = False
                torch.autograd.graph.register_multi_grad_hook(needs_grad, self._regather_for_backward, mode="any")
        self._grads_pending |= torch.is_grad_enabled()  # an evaluation forward leaves nothing to reduce
        return out

    def _regather_for_backward(self, grad: torch.Tensor) -> None:
        if self._gathered_for_backward:
            return
        self._gathered_for_backward = True
        self._gather_params()
        # Free the gathered parameters again once this backward pass has finished.
        torch.autograd.Variable._execution_engine.queue_callback(self._release_params)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (the earlier micro-batches of a step)."""
        if self.buckets is None:  # gradients wait in .grad until the step anyway
            yield
            return
        self.buckets.sync = False
        try:
            yield
        finally:
            self.buckets.sync = True

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp x cp ranks into `main_grads` (the step calls this)."""
        if not self._grads_pending:
            return
        if self.buckets is not None:  # already summed bucket by bucket during backward
            self.buckets.finish()
            self.main_grads.div_(self.group.size)
            self._grads_pending = False
            return
        if self.tp is not None:
            self.module.sync_grads()
        # DDP and ZeRO-1 collect into the persistent full buffer; ZeRO-2/3 only into a temporary one.
        if self.config.zero_stage >= 2:
            full = torch.zeros(self.padded_numel, dtype=self.config.torch_reduce_dtype, device=self.device)
        else:
            full = self.main_grads
        offset = 0
        for _, p in self._named:
            if p.grad is not None:
                full[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            else:
                full[offset:offset + p.numel()].zero_()
            p.grad = None
            offset += p.numel()
        wire = full.to(self.config.torch_reduce_dtype)  # no copy when the dtypes already agree
        if self.shards == 1:
            self.main_grads.copy_(comm.all_reduce(wire, self.group))
        else:
            self.owned_grads().copy_(comm.reduce_scatter(wire, self.group))
        self.owned_grads().div_(self.group.size)
        self._grads_pending = False

    def owned_grads(self) -> torch.Tensor:
        """This rank's averaged main gradients, aligned with `main_params` (after `reduce_gradients`)."""
        return self.main_grads if self.config.zero_stage >= 2 else self.main_grads[self.owned]

    def after_step(self) -> None:
        """Copy updated main params into the model dtype, then sync parameters as the stage prescribes."""
        if self.config.mixed_precision:
            with torch.no_grad():
                self.param_shard.copy_(self.main_params)
        if self.config.distributed_optimizer:
            self._gather_params()
        elif self.config.shards_optimizer and not self.zero3:
            self._params_stale = True

    def decay_mask(self) -> torch.Tensor:
        """True for the owned elements of matrices (weight decay applies), False for norms and biases."""
        return self._owned_mask(lambda name, p: p.dim() >= 2)

    def norm_mask(self) -> torch.Tensor | None:
        """True for the owned elements that enter the global gradient norm on this rank (None: all of them);
        under tensor parallelism each distinct element counts on exactly one tp rank."""
        if self.tp is None:
            return None
        return self._owned_mask(lambda name, p: self.placements[name].counts_in_norm(self.tp.rank))

    def _owned_mask(self, rule) -> torch.Tensor:
        mask = torch.zeros(self.padded_numel, dtype=torch.bool, device=self.device)
        offset = 0
        for name, p in self._named:
            mask[offset:offset + p.numel()] = rule(name, p)
            offset += p.numel()
        return mask[self.owned].clone()

    # ---- layout-independent state (checkpoints) -----------------------------------------------------

    def _gather_owned(self, owned: torch.Tensor) -> torch.Tensor:
        """The full padded flat buffer from every rank's owned slice (no copy when nothing is sharded)."""
        if self.shards == 1:
            return owned
        full = owned.new_empty(self.padded_numel)
        comm.all_gather_into(full, owned.contiguous(), self.group)
        return full

    def _by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Whole tensors by parameter name from a full flat buffer (gathered over tp when sharded)."""
        out, offset = {}, 0
        for name, p in self._named:
            local = flat[offset:offset + p.numel()].view(p.shape).clone()
            out[name] = local if self.tp is None else gather_tensor(local, self.placements[name], self.tp)
            offset += p.numel()
        return out

    def _flat_from(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        missing = [name for name, _ in self._named if name not in tensors]
        if missing:
            raise KeyError(f"state has no entry for {missing[0]!r} (and {len(missing) - 1} more)")
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        offset = 0
        for name, p in self._named:
            local = tensors[name]
            if self.tp is not None:
                local = shard_tensor(local, self.placements[name], self.tp.size, self.tp.rank)
            if tuple(local.shape) != tuple(p.shape):
                raise ValueError(f"{name}: state holds shape {tuple(tensors[name].shape)}, which does not fit the "
                                 f"model's {tuple(p.shape)} on this layout")
            flat[offset:offset + p.numel()].copy_(local.reshape(-1))
            offset += p.numel()
        return flat

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Whole averaged gradients by parameter name, on every rank (after `reduce_gradients`)."""
        return self._by_name(self._gather_owned(self.owned_grads()))

    def full_state(self, optimizer: ShardedAdamW) -> dict[str, Any]:
        """Whole (unsharded) main parameters and AdamW moments by parameter name, on every rank.

        The same on any layout, so a run can resume on another one. Gathers over dp_cp when sharded.
        """
        adamw = optimizer.adamw
        return {
            "params": self._by_name(self._gather_owned(self.main_params)),
            "exp_avg": self._by_name(self._gather_owned(adamw.exp_avg)),
            "exp_avg_sq": self._by_name(self._gather_owned(adamw.exp_avg_sq)),
            "optimizer_steps": adamw.steps,
        }

    def load_full_state(self, state: dict[str, Any], optimizer: ShardedAdamW) -> None:
        """Take this rank's share of a `full_state` (from any layout) into params, main params and moments."""
        adamw = optimizer.adamw
        main = self._flat_from(state["params"], self.main_params.dtype)
        with torch.no_grad():
            self.main_params.copy_(main[self.owned])
            if self.config.mixed_precision:
                self.param_shard.copy_(main[self.owned])
            if not self.zero3:
                self.flat_params.copy_(main)  # every rank holds full parameters outside ZeRO-3
            adamw.exp_avg.copy_(self._flat_from(state["exp_avg"], adamw.exp_avg.dtype)[self.owned])
            adamw.exp_avg_sq.copy_(self._flat_from(state["exp_avg_sq"], adamw.exp_avg_sq.dtype)[self.owned])
        adamw.steps = int(state["optimizer_steps"])
        self._params_stale = False

    def optimizer(self, lr: float, **adamw: Any) -> ShardedAdamW:
        """AdamW over this rank's shard (the whole buffer under DDP)."""
        return ShardedAdamW(self, lr=lr, **adamw)


class ShardedAdamW:
    """AdamW on the slice of the flat parameters a rank owns; `step()` reduces gradients first."""

    def __init__(self, dp: DataParallel, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_matrices_only: bool = True) -> None:
        self.dp = dp
        mask = dp.decay_mask() if weight_decay and decay_matrices_only else None
        self.norm_mask = dp.norm_mask()
        self.adamw = FlatAdamW(dp.main_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               decay_mask=mask)

    @property
    def lr(self) -> float:
        return self.adamw.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.adamw.lr = value

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping."""
        self.dp.reduce_gradients()
        grads = self.dp.owned_grads()
        counted = grads.square()
        if self.norm_mask is not None:  # tensor parallel: each distinct element once over tp
            counted.masked_fill_(~self.norm_mask, 0)
        squares = counted.sum().reshape(1)
        if self.dp.shards > 1:
            squares = comm.all_reduce(squares, self.dp.group)
        if self.dp.tp is not None:
            squares = comm.all_reduce(squares, self.dp.tp)
        norm = squares.sqrt()[0]
        if max_norm < float("inf"):  # "no clipping" must not multiply an infinite norm's grads by inf/inf
            grads.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def step(self) -> None:
        self.dp.reduce_gradients()
        self.adamw.step(self.dp.owned_grads())
        self.dp.after_step()

    def zero_grad(self) -> None:
        for _, p in self.dp._named:
            p.grad = None
        if self.dp.buckets is not None:  # gradients accumulate in the flat buffer itself
            self.dp.main_grads.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.adamw.state_tensors()


def _tensors(out: Any) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _tensors(item)]
    return []
