"""The reference decoder: pre-norm blocks, name-seeded initialization, loss with ignored labels."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from .config import ModelSpec, check_runnable
from .documents import Documents
from .layers import Attention, RMSNorm, SwiGLU, rope_tables
from .moe import MoE
from .token_io import TokenIO

# Output projections feed the residual stream; scaling them keeps its variance flat in depth (GPT-2).
_RESIDUAL_OUTPUTS = ("wo", "w2")


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # fits the generator's signed 64-bit seed


def init_parameter(name: str, shape: tuple[int, ...] | torch.Size, cfg: ModelSpec, seed: int) -> torch.Tensor:
    """The initial value of parameter `name` (its qualified name in `Transformer`), float32 on CPU.

    A pure function of (name, shape, cfg, seed): a sharded copy regenerates the full tensor and slices it.
    Norm weights are ones; other parameters are normal(0, init_std), divided by sqrt(2 * num_layers) for the
    residual output projections (`wo`, `w2`, including stacked expert `w2`).
    """
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2].endswith("norm"):
        return torch.ones(shape)
    std = cfg.init_std
    if any(p in _RESIDUAL_OUTPUTS for p in parts[-2:]):
        std /= math.sqrt(2 * cfg.num_layers)
    gen = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.normal(0.0, std, size=tuple(shape), generator=gen)


class KeepActivations(nn.Module):
    """How a block runs its body on one device: straight through, autograd keeping what the body saves.

    forward(body, x, cos, sin, token_mask, documents) -> body(x, cos, sin, token_mask, documents).
    `TransformerBlock.recompute` holds this module: the seam where activation recompute puts a version that keeps
    only the body's inputs and replays it in backward (`orangetron/parallel/recompute.py`), with the same signature.
    """

    def forward(self, body: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, token_mask: torch.Tensor | None,
                documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return body(x, cos, sin, token_mask, documents)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(.)); x: [B, S, dim].

    The body runs through the seam `recompute` (`KeepActivations` here). An MoE block's `feed_forward.last_aux_loss`
    is set from what the body hands back, so a body replayed in backward changes no state of the block.
    """

    def __init__(self, cfg: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(layer_idx) else SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size)
        self.recompute = KeepActivations()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_mask: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        moe = isinstance(self.feed_forward, MoE)
        # A dense block never reads the mask: it is not handed over, so nothing keeps it for this block.
        h, aux_loss = self.recompute(self.body, x, cos, sin, token_mask if moe else None, documents)
        if moe:
            self.feed_forward.last_aux_loss = aux_loss
        return h

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_mask: torch.Tensor | None,
             documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's computation: (output [B, S, dim], the MoE's auxiliary loss or None); no state changes,
        except the routers' load counts of a forward with gradients (`Router`)."""
        h = x + self.attention(self.attention_norm(x), cos, sin, documents)
        if isinstance(self.feed_forward, MoE):
            y, aux_loss = self.feed_forward.with_aux_loss(self.ffn_norm(h), token_mask)
            return h + y, aux_loss
        return h + self.feed_forward(self.ffn_norm(h)), None


class Transformer(nn.Module):
    """Llama-style decoder with optional MoE layers; forward(tokens [B, S]) -> logits [B, S, vocab].

    Parameters are created in `dtype` on `device` and initialized by `init_parameter` from (seed, cfg)
    alone; the global RNG is left as it was. With `tied_embeddings`, `output` is None and the embedding
    matrix projects to logits. `io` (a `TokenIO`) lays out the sequence and computes logits and the cross
    entropy; `orangetron/parallel/contract.py` lists what parallel code relies on.
    """

    def __init__(
        self, cfg: ModelSpec, *, seed: int = 0, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_runnable(cfg)  # a spec only the planner prices (latent attention, learned positions ...) stops here
        self.cfg, self.seed = cfg, seed
        device = torch.device(device if device is not None else "cpu")
        # nn's default init draws from the global RNG; fork it so building a model leaves callers' random
        # streams alone. (A meta-device build would skip that init, but its first use imports
        # torch._dynamo: seconds of start-up on a small machine.)
        rng_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), device:
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.output = None if cfg.tied_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.io = TokenIO()
        self.to(dtype)
        self.reset_parameters()
        self._whole_numel = sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialize every parameter from (seed, cfg, its qualified name)."""
        for name, p in self.named_parameters():
            p.copy_(init_parameter(name, p.shape, self.cfg, self.seed))

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """tokens: [B, S] int64; position_ids: [B, S] or [S] (default 0..S-1) -> logits [B, S, vocab].

        token_mask: [B, S] bool, False at padding; only the MoE load-balancing loss reads it. `documents`
        (packed rows): attention stays inside each document and positions default to `documents.positions()`.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, S]; got shape {tuple(tokens.shape)}")
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"seq_len={seq_len}: exceeds max_seq_len={self.cfg.max_seq_len}")
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=tokens.device) if documents is None else documents.positions()
        h = self.embed(tokens)  # [B, S, dim]
        cos, sin = rope_tables(position_ids, self.cfg, h.dtype)
        token_mask = self.routing_mask(token_mask)
        for layer in self.layers:
            h = layer(h, cos, sin, token_mask, documents)
        return self.head(h)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> the first layer's input [B, S, dim] (a pipeline's first stage runs this alone)."""
        # The embedding keeps the ids for backward; a copy keeps them from pinning a larger tensor they view.
        return self.tok_embeddings(tokens.clone(memory_format=torch.contiguous_format))

    def routing_mask(self, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the tokens the MoE layers route (all of them on one device; `io` decides)."""
        return self.io.routing_mask(token_mask)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's output [B, S, dim] -> logits [B, S, vocab]: final norm, output projection."""
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return self.io.logits(self.norm(h), weight)  # [B, S, vocab]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' load-balancing losses from the last forward; a 0-d zero when dense."""
        total = torch.zeros((), device=self.tok_embeddings.weight.device)
        for layer in self.layers:
            ff = layer.feed_forward
            if isinstance(ff, MoE) and ff.last_aux_loss is not None:
                total = total + ff.last_aux_loss
        return total

    def loss(
        self, tokens: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """Mean cross entropy over labels != ignore_index, in float32 (float64 for float64), plus aux loss.

        labels: [B, S] int64, already shifted. Positions whose label is ignored are padding: they are kept
        out of the load-balancing loss too. All-ignored labels give a cross entropy of 0, not NaN.
        """
        logits = self.forward(tokens, position_ids, token_mask=labels != ignore_index)
        return self.loss_from_logits(logits, labels, ignore_index)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """`loss` for logits [B, S, V] already computed (by a wrapper such as ParallelModel) by this model."""
        return self.cross_entropy(logits, labels, ignore_index) + self.aux_loss()

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross entropy of logits [B, S, V] over labels != ignore_index, without the aux loss."""
        return self.io.cross_entropy(logits, labels, ignore_index)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters of the whole model (a tied matrix counts once), counted when it was
        built: the same after `parallelize` shards the parameters in place."""
        embeddings = self.cfg.vocab_size * self.cfg.hidden_size if exclude_embeddings else 0
        return self._whole_numel - embeddings
