"""What the parallel code relies on from a model: the contract `parallelize` checks on entry.

The reference `orangetron.model.transformer.Transformer` satisfies it (`tests/test_parallelize_contract.py`).
Each member is listed because some dimension reads or replaces it:

- the root: `cfg` (layout checks, rotary tables, stage shapes), the slots `tok_embeddings`, `layers`, `norm`,
  `output` and `io` (tensor parallelism replaces them; a pipeline stage empties the ones it does not run; `io`
  offers `routing_mask`, `hidden_len`, `logits` and `cross_entropy`),
  and the methods a pipeline stage and the training step call on parts of the model: `embed`,
  `routing_mask`, `head`, `cross_entropy`, `loss_from_logits`, `aux_loss`;
- each block of `layers`: called as `block(h, cos, sin, token_mask, documents)` (documents: None, or those of
  packed rows, which its attention core takes as a fourth argument), with `attention` (tensor parallelism
  takes over `wq`, `wk`, `wv`, `wo`, `q_norm`, `k_norm`,
  `head_dim`; context parallelism fills the seam `core_attention`),
  `feed_forward` (a dense MLP that tensor parallelism replaces, or an `orangetron.model.moe.MoE`) and the seam
  `recompute`, through which the block runs its body (activation recompute fills it);
- each MoE: `router` (with `n_experts`, the loss coefficients and the seam `aux_losses`), `experts` (whose
  `w1`, `w3`, `w2` expert parallelism slices), `shared_expert`, the seam `dispatcher`, and `last_aux_loss`.

Every change goes through `orangetron/parallel/replace.py`'s `replace_module`, at the names listed here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from orangetron.model.documents import Documents
from orangetron.model.moe import MoE
from orangetron.spec.model import ModelSpec


@runtime_checkable
class ModelContract(Protocol):
    """The root module `parallelize` takes (an `nn.Module`)."""

    cfg: ModelSpec  # the model's description (orangetron/spec/model.py)
    tok_embeddings: nn.Module | None
    layers: nn.ModuleList  # on a pipeline stage, an nn.ModuleDict of its layers by global index
    norm: nn.Module | None
    output: nn.Module | None
    io: nn.Module  # see ParallelIOParts

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def routing_mask(self, token_mask: torch.Tensor | None) -> torch.Tensor | None: ...

    def head(self, h: torch.Tensor) -> torch.Tensor: ...

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor: ...

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor: ...

    def aux_loss(self) -> torch.Tensor: ...


@runtime_checkable
class ParallelIOParts(Protocol):
    """The root's `io` (`orangetron/model/token_io.py`): what tensor parallelism replaces at the decoder's ends."""

    def routing_mask(self, token_mask: torch.Tensor | None) -> torch.Tensor | None: ...

    def hidden_len(self, seq_len: int) -> int: ...

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor: ...


@runtime_checkable
class ParallelBlock(Protocol):
    """One entry of `layers`."""

    attention: nn.Module
    feed_forward: nn.Module
    recompute: nn.Module  # runs the block's body: (body, h, cos, sin, token_mask, documents) -> (out, aux or None)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 token_mask: torch.Tensor | None, documents: Documents | None = None) -> torch.Tensor: ...


@runtime_checkable
class ParallelAttentionParts(Protocol):
    """A block's `attention`: projections [out, in] and the attention core seam (q, k, v) -> out."""

    wq: nn.Linear
    wk: nn.Linear
    wv: nn.Linear
    wo: nn.Linear
    q_norm: nn.Module | None  # QK-norm over one head, or None
    k_norm: nn.Module | None
    head_dim: int
    core_attention: nn.Module


@runtime_checkable
class ParallelMoEParts(Protocol):
    """A block's `feed_forward` when it is an MoE."""

    router: nn.Module  # n_experts, aux_loss_coef, z_loss_coef, aux_losses
    experts: nn.Module  # w1, w3, w2: [E, ...]
    shared_expert: nn.Module | None
    dispatcher: nn.Module
    last_aux_loss: torch.Tensor | None


class ModelContractError(TypeError):
    """The model lacks members the parallel code relies on."""


def _members(protocol: type) -> list[str]:
    names = list(protocol.__annotations__)
    return names + [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


def _missing(obj: object, protocol: type, prefix: str) -> list[str]:
    return [f"{prefix}{name}" for name in _members(protocol) if not hasattr(obj, name)]


def missing_members(model: object) -> list[str]:
    """Qualified names of the contract's members that `model` lacks (empty when it satisfies the contract)."""
    missing = [] if isinstance(model, nn.Module) else ["(an nn.Module)"]
    missing += _missing(model, ModelContract, "")
    if hasattr(model, "io"):
        missing += _missing(model.io, ParallelIOParts, "io.")
    layers = getattr(model, "layers", None) or []
    for i, block in layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers):
        missing += _missing(block, ParallelBlock, f"layers.{i}.")
        if hasattr(block, "attention"):
            missing += _missing(block.attention, ParallelAttentionParts, f"layers.{i}.attention.")
        if isinstance(getattr(block, "feed_forward", None), MoE):
            ff = block.feed_forward
            missing += _missing(ff, ParallelMoEParts, f"layers.{i}.feed_forward.")
            for name in ("n_experts", "aux_loss_coef", "z_loss_coef", "aux_losses"):
                missing += [] if hasattr(ff.router, name) else [f"layers.{i}.feed_forward.router.{name}"]
    return missing


def check_model(model: object) -> None:
    """Raise `ModelContractError` naming every member of the contract that `model` lacks."""
    missing = missing_members(model)
    if missing:
        raise ModelContractError(f"{type(model).__name__} cannot be parallelized: it lacks {', '.join(missing)} "
                                 "(orangetron/parallel/contract.py lists what the parallel code relies on)")
