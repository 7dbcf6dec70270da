"""How the next token is chosen from the logits: greedy, or drawn at a temperature from the top k."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .moe import top_indices


@dataclass(frozen=True)
class Sampling:
    """The decoding rule, checked when built (ValueError naming the field, the value and the rule)."""

    temperature: float = 0.0
    """0: greedy (the most likely token); > 0: draw from softmax(logits / temperature)."""
    top_k: int = 0
    """> 0: draw only among the k most likely tokens; 0: among all. Ignored when greedy."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 keeps every token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def token_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution a token is drawn from: logits [B, V] -> probabilities [B, V] (float32, float64 for
    float64), 0 outside the top k (ties at the k-th value go to the lower token id). Needs temperature > 0."""
    if sampling.greedy:
        raise ValueError("temperature=0: greedy decoding draws nothing; use next_token")
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Shifted by each row's largest first: a tiny temperature then sends the others to -inf, not every logit to
    # +-inf (1e-45 gave inf - inf = nan in softmax and a traceback from multinomial).
    scaled = (wide - wide.max(-1, keepdim=True).values) / sampling.temperature  # [B, V]
    if 0 < sampling.top_k < scaled.shape[-1]:
        kept = top_indices(scaled, sampling.top_k)  # [B, k]
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, kept, scaled.gather(-1, kept))
    return scaled.softmax(-1)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row: logits [B, V] -> [B] int64. Greedy takes the first largest logit; otherwise
    one draw from `token_probs` with `generator` (same seed, same logits: same token)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(token_probs(logits, sampling), 1, generator=generator).squeeze(-1)
