"""Dense building blocks: RMSNorm, rotary embedding, SwiGLU and grouped-query attention with its core."""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import attention_kernel, document_attention
from .autograd import RMSNormFunction, swiglu_activation
from .config import ModelSpec
from .documents import Documents


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, computed in float32 (float64 for float64).

    Keeps only x for backward (and the weight); 1/rms is recomputed.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, cfg: ModelSpec | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """The rotary frequencies [head_dim // 2] in float64: theta^(-2i/head_dim), scaled as `cfg.rope_scaling`
    says ("llama3": Llama 3.1's rule, the formula of Hugging Face's `_compute_llama3_parameters`)."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim}: must be even for rotary embeddings")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if cfg is None or cfg.rope_scaling == "none":
        return inv_freq
    factor, old_len = cfg.rope_scaling_factor, cfg.rope_original_max_positions
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long wavelengths: / factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(between, smoothed, scaled)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32,
    cfg: ModelSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for explicit positions.

    position_ids: [B, S] or [S] integer positions (any order, not necessarily 0..S-1, so a context-parallel
    rank can pass the global positions of its chunks). Returns cos, sin: [..., S, head_dim // 2] in `dtype`.
    Angles are computed in float64, so a position's table is the same whatever else is in the batch. `cfg`
    gives the frequency scaling (`rope_inv_freq`); None: none.
    """
    inv_freq = rope_inv_freq(head_dim, theta, cfg, position_ids.device)  # [D/2]
    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq  # [..., S, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_tables(position_ids: torch.Tensor, cfg: ModelSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` for the model `cfg` describes (its head width, base and scaling)."""
    return rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, dtype, cfg)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [B, S, H, D] by position; cos, sin: [B, S, D/2] or [S, D/2] from `rope_cos_sin`.

    Pairs dimension i with i + D/2 (the "rotate half" convention). Returns x's shape and dtype.
    """
    half = x.shape[-1] // 2
    if cos.shape[-1] != half or cos.shape[-2] != x.shape[1]:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match x {tuple(x.shape)}: expected [..., S, D/2]")
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads: [..., S, 1, D/2]
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up projection, w2 the down projection.

    Keeps x, the gate, the up projection and their product for backward (silu is recomputed).
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_activation(self.w1(x), self.w3(x)))


class CausalAttention(nn.Module):
    """The attention core of `Attention`: causal attention over the local sequence by `attention_kernel`.

    q: [B, S, Hq, D], k, v: [B, S, Hk, D] -> out [B, S, Hq, D]. `impl` selects the kernel implementation. With
    `documents` (packed rows) attention is block-diagonal causal over them (`document_attention`).
    `Attention.core_attention` holds this module: the one seam where context parallelism puts its own core
    (`orangetron/parallel/context/core.py`), with the same signature.
    """

    def __init__(self, impl: str = "fused") -> None:
        super().__init__()
        self.impl = impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        if documents is not None:
            return document_attention(q, k, v, documents, impl=self.impl)[0]
        out, _ = attention_kernel(q, k, v, causal=True, impl=self.impl)
        return out


def attention_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, cos: torch.Tensor,
                    sin: torch.Tensor, q_norm: nn.Module | None = None,
                    k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections q [B, S, Hq*D], k, v [B, S, Hk*D] -> heads q [B, S, Hq, D], k, v [B, S, Hk, D]: q and k
    normalized per head by `q_norm`, `k_norm` when given (QK-norm, as Qwen3: before the rotation), then rotated by
    (cos, sin). The reference and the tensor-parallel attention (any number of local heads) share it."""
    b, s, _ = q.shape
    q = q.view(b, s, -1, head_dim)  # [B, S, Hq, D]
    k = k.view(b, s, -1, head_dim)  # [B, S, Hk, D]
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(b, s, -1, head_dim)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embedding; x: [B, S, dim] -> [B, S, dim].

    Head counts are read from the projection sizes at run time, so a tensor-parallel copy with sliced
    wq/wk/wv/wo works unchanged. `cfg.qkv_bias` gives wq, wk and wv biases (wo has none); `cfg.qk_norm` adds
    `q_norm` and `k_norm`, RMSNorms over one head (None without). The attention itself runs in the submodule
    `core_attention` (a `CausalAttention`, whose kernel `kernel_impl` selects); context parallelism replaces
    that submodule.
    """

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = cfg.has_qkv_bias
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core_attention = CausalAttention()

    @property
    def kernel_impl(self) -> str:
        """The `attention_kernel` implementation of the local core ("fused" or "reference")."""
        return self.core_attention.impl

    @kernel_impl.setter
    def kernel_impl(self, impl: str) -> None:
        self.core_attention.impl = impl

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        # Unpacked rows call the core as (q, k, v) alone, which every core takes.
        out = self.core_attention(q, k, v) if documents is None else self.core_attention(q, k, v, documents)
        return self.wo(out.reshape(b, s, -1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, S, dim] -> q [B, S, Hq, D], k, v [B, S, Hk, D], q and k rotated by (cos, sin) of their positions.

        `forward` and cached decoding (model/decode.py), which attends over earlier positions' k and v, share it.
        """
        return attention_heads(self.wq(x), self.wk(x), self.wv(x), self.head_dim, cos, sin, self.q_norm, self.k_norm)
