"""One flat data-parallel buffer: the parameters it holds, the group it shards over, and its slices.

`DataParallel` keeps one for the dense parameters (over dp x cp) and, under expert parallelism, one for the
routed experts (over edp): each rank owns `[r * s, (r + 1) * s)` of every buffer of a part, with
`s = ceil(numel / n)` (`plan.sharding`, shared with the planner).
"""

from __future__ import annotations

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.config import ParallelConfig
from orangetron.plan.sharding import padded_numel, shard_numel


class FlatPart:
    """Flat parameter, main-gradient and main-parameter buffers of `named` parameters over `group`."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group: MeshGroup, config: ParallelConfig,
                 device: torch.device) -> None:
        self.named, self.group, self.config, self.device = named, group, config, device
        self.zero3 = config.zero_stage == 3
        self.shards = group.size if config.shards_optimizer else 1
        self.numel = sum(p.numel() for _, p in named)
        self.shard_numel = shard_numel(self.numel, self.shards)
        self.padded_numel = padded_numel(self.numel, self.shards)
        start = group.rank * self.shard_numel if self.shards > 1 else 0
        self.owned = slice(start, start + self.shard_numel)  # this rank's slice of every flat buffer
        self._build()

    def _build(self) -> None:
        cfg = self.config
        flat = torch.zeros(self.padded_numel, dtype=cfg.torch_param_dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for _, p in self.named:
                flat[offset:offset + p.numel()].copy_(p.reshape(-1))
                p.data = flat[offset:offset + p.numel()].view(p.shape)  # the module now computes on `flat`
                offset += p.numel()
        self.flat_params = flat
        self.param_shard = flat[self.owned].clone() if self.zero3 else flat[self.owned]
        main_dtype = torch.float32 if cfg.mixed_precision else cfg.torch_param_dtype
        self.main_params = self.param_shard.to(main_dtype, copy=True) if cfg.mixed_precision else self.param_shard
        grads = self.shard_numel if cfg.zero_stage >= 2 else self.padded_numel
        self.main_grads = torch.zeros(grads, dtype=main_dtype, device=self.device)
        if self.zero3:
            self.release()

    def release(self) -> None:
        # The parameters stay views of `flat_params`; only its storage goes (tensors saved for backward
        # keep referring to it and see the values again once it is re-gathered).
        self.flat_params.untyped_storage().resize_(0)

    def gather(self) -> None:
        nbytes = self.padded_numel * self.flat_params.element_size()
        if self.flat_params.untyped_storage().nbytes() != nbytes:
            self.flat_params.untyped_storage().resize_(nbytes)
        # Under ZeRO-1/2 the shard is a view of the buffer being gathered into, so it travels as a copy.
        shard = self.param_shard if self.zero3 else self.param_shard.clone()
        comm.all_gather_into(self.flat_params, shard, self.group)

    def reduce(self, divisor: int) -> None:
        """Sum the parameters' gradients over the group into `main_grads`, divided by `divisor`."""
        cfg = self.config
        # DDP and ZeRO-1 collect into the persistent full buffer; ZeRO-2/3 only into a temporary one.
        if cfg.zero_stage >= 2:
            full = torch.zeros(self.padded_numel, dtype=cfg.torch_reduce_dtype, device=self.device)
        else:
            full = self.main_grads
        offset = 0
        for _, p in self.named:
            if p.grad is not None:
                full[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            else:
                full[offset:offset + p.numel()].zero_()
            p.grad = None
            offset += p.numel()
        wire = full.to(cfg.torch_reduce_dtype)  # no copy when the dtypes already agree
        if self.shards == 1:
            self.main_grads.copy_(comm.all_reduce(wire, self.group))
        else:
            self.owned_grads().copy_(comm.reduce_scatter(wire, self.group))
        self.owned_grads().div_(divisor)

    def owned_grads(self) -> torch.Tensor:
        return self.main_grads if self.config.zero_stage >= 2 else self.main_grads[self.owned]

    def owned_mask(self, rule) -> torch.Tensor:
        mask = torch.zeros(self.padded_numel, dtype=torch.bool, device=self.device)
        offset = 0
        for name, p in self.named:
            mask[offset:offset + p.numel()] = rule(name, p)
            offset += p.numel()
        return mask[self.owned].clone()

    def gather_owned(self, owned: torch.Tensor) -> torch.Tensor:
        """The full padded flat buffer from every rank's owned slice (no copy when nothing is sharded)."""
        if self.shards == 1:
            return owned
        full = owned.new_empty(self.padded_numel)
        comm.all_gather_into(full, owned.contiguous(), self.group)
        return full

    def locals_by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, p in self.named:
            out[name] = flat[offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        return out

    def flat_from(self, local: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        offset = 0
        for name, p in self.named:
            flat[offset:offset + p.numel()].copy_(local[name].reshape(-1))
            offset += p.numel()
        return flat
