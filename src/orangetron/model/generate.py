"""Text generation with the reference `Transformer`: feed the prompt, then each chosen token, one sequence.

With the key/value cache (`model/decode.py`) each step runs the new token only; without it every step runs
the model's plain forward over the whole sequence so far, the slow path that the cached one is checked
against. Both choose tokens by the same `Sampling` rule from the same generator.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from .decode import KVCache, forward_cached
from .sampling import GREEDY, Sampling, next_token
from .transformer import Transformer


@dataclass(frozen=True)
class Generation:
    """The new tokens and, per token, the logits it was chosen from."""

    tokens: torch.Tensor  # [N] int64
    logits: torch.Tensor  # [N, vocab], before temperature: row i predicts tokens[i]


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = GREEDY, *,
             seed: int = 0, use_cache: bool = True, stop_ids: Collection[int] = ()) -> Generation:
    """Continue `prompt` [S] int64 (S >= 1) by `max_new_tokens` tokens chosen by `sampling`, on the model's device,
    or fewer: a token of `stop_ids` (an end of document) is the last, kept, as transformers' `generate` keeps its
    eos_token_id.

    Deterministic: the draws come from a generator seeded with `seed`, so the same model, prompt, rule and
    seed give the same tokens (with or without the cache). ValueError when the prompt is empty or the
    prompt and the new tokens would not fit in the model's `max_seq_len`. The model's state is left as it
    was (no gradients; routers count no load).
    """
    check_length(model, prompt.numel(), max_new_tokens)
    weight = model.tok_embeddings.weight
    prompt = prompt.to(weight.device)
    generator = torch.Generator(device=weight.device).manual_seed(seed)  # draws on the logits' device
    feed = _cached_feed(model, prompt.numel() + max_new_tokens) if use_cache else _full_feed(model)
    tokens, logits = [], []
    pending = prompt.view(1, -1)  # [1, S]: the tokens the model has not seen yet
    for _ in range(max_new_tokens):
        step_logits = feed(pending)  # [1, vocab]: the prediction after the last token fed
        token = next_token(step_logits, sampling, generator)  # [1]
        tokens.append(token)
        logits.append(step_logits)
        if stop_ids and int(token) in stop_ids:  # a read back to the host only when a stop is asked for
            break
        pending = token.view(1, 1)
    if not tokens:
        return Generation(prompt.new_zeros(0), weight.new_zeros(0, model.cfg.vocab_size))
    return Generation(torch.cat(tokens), torch.cat(logits))


def check_length(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    """ValueError unless 1 <= prompt_len and prompt_len + max_new_tokens <= the model's max_seq_len."""
    if prompt_len < 1:
        raise ValueError("prompt is empty: generation continues at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    limit = model.cfg.max_seq_len
    if prompt_len + max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the prompt's {prompt_len} tokens and "
                         f"{max_new_tokens} new ones make {prompt_len + max_new_tokens}, past the model's "
                         f"max_seq_len={limit}")


def _cached_feed(model: Transformer, capacity: int) -> Callable[[torch.Tensor], torch.Tensor]:
    cache = KVCache.for_model(model, batch=1, capacity=capacity)
    return lambda new: forward_cached(model, new, cache)[:, -1]


def _full_feed(model: Transformer) -> Callable[[torch.Tensor], torch.Tensor]:
    seen: list[torch.Tensor] = []

    def feed(new: torch.Tensor) -> torch.Tensor:
        seen.append(new)
        return model(torch.cat(seen, dim=1))[:, -1]  # the plain forward over everything so far

    return feed
