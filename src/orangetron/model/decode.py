"""Incremental decoding of the reference `Transformer`: a key/value cache and a forward over new tokens only.

`forward_cached` runs the blocks' own modules (norms, projections, feed-forward, head) in the order
`Transformer.forward` does, so weights and arithmetic are the same; only attention differs, reading the keys
and values of earlier positions from the cache instead of recomputing them. It serves the unparallelized
reference model: after `parallelize` the blocks hold other modules, and their attention spans ranks.

The MoE layers run as an evaluation forward does (no gradients), so routing is the training forward's but
the routers count no load and their biases never move: sampling leaves a model as it found it.
"""

from __future__ import annotations

import torch

from .attention import attention_kernel
from .layers import Attention, rope_tables
from .transformer import Transformer, TransformerBlock


class KVCache:
    """Per layer, the rotated keys and the values of positions [0, length) of a batch, in buffers of
    `capacity` positions: keys[i], values[i]: [B, capacity, Hk, D]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.length = 0  # positions filled; the next token fed sits at this position

    @classmethod
    def for_model(cls, model: Transformer, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `capacity` tokens, in the model's dtype and device."""
        cfg, weight = model.cfg, model.tok_embeddings.weight
        shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        make = lambda: torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        return cls([make() for _ in model.layers], [make() for _ in model.layers])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, S, Hk, D] at positions [length, length + S) of `layer`; returns that layer's keys and
        values [B, length + S, Hk, D]. `length` moves once every layer has its new positions (`advance`)."""
        end = self.length + k.shape[1]
        self.keys[layer][:, self.length:end] = k
        self.values[layer][:, self.length:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, n: int) -> None:
        self.length += n


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, S, vocab] of tokens [B, S] int64 that follow the cache's positions, the first at position
    `cache.length`; their keys and values join the cache.

    Equals `model(whole sequence)[:, cache.length:]` (the same kernel; float64 within rounding). Either the
    cache is empty (a whole prompt, attended causally) or S == 1 (one token that sees every cached key);
    the kernel's causal mask knows no offset. ValueError past the cache's capacity.
    """
    start, s = cache.length, tokens.shape[1]
    if start > 0 and s != 1:
        raise ValueError(f"{s} tokens after {start} cached ones: feed the prompt whole, then one token at a time")
    if start + s > cache.capacity:
        raise ValueError(f"position {start + s - 1} is past the cache's capacity of {cache.capacity} tokens")
    h = model.embed(tokens)  # [B, S, dim]
    positions = torch.arange(start, start + s, device=tokens.device)  # absolute: rotary angles follow them
    cos, sin = rope_tables(positions, model.cfg, h.dtype)
    for i, block in enumerate(model.layers):
        h = _block(block, h, cos, sin, cache, i)
    cache.advance(s)
    return model.head(h)


def _block(block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
           layer: int) -> torch.Tensor:
    """`TransformerBlock.forward` with cached attention; the feed-forward (dense or MoE) sees no padding mask,
    as in a forward given none."""
    h = x + _attention(block.attention, block.attention_norm(x), cos, sin, cache, layer)
    return h + block.feed_forward(block.ffn_norm(h))


def _attention(attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
               layer: int) -> torch.Tensor:
    b, s, _ = x.shape
    q, k, v = attention.qkv(x, cos, sin)  # q [B, S, Hq, D]; k, v [B, S, Hk, D]
    keys, values = cache.extend(layer, k, v)  # [B, length + S, Hk, D]; the kernel groups kv heads itself
    causal = cache.length == 0  # a whole prompt; a single later token may see every key
    out, _ = attention_kernel(q, keys, values, causal=causal, impl=attention.kernel_impl)  # [B, S, Hq, D]
    return attention.wo(out.reshape(b, s, -1))
