"""`TokenIO`: where the decoder meets the token sequence and the vocabulary, as one replaceable part.

`Transformer.io` holds it. Between the layers the activations lie along the sequence in some way, the routers
see a padding mask laid out the same way, and the last hidden state becomes logits that a cross entropy
scores. On one device all of these are the obvious ones, here; tensor parallelism puts its own module with
the same methods at `Transformer.io` (`orangetron/parallel/tensor.py`'s `TensorParallelIO`: vocabulary-
sharded logits and cross entropy, sequence-sharded activations under sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .autograd import CrossEntropy


class TokenIO(nn.Module):
    """The single-device ends of the decoder: whole sequences, whole-vocabulary logits."""

    def routing_mask(self, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask [B, S] of the tokens the MoE layers route (all of them on one device)."""
        return token_mask

    def hidden_len(self, seq_len: int) -> int:
        """The sequence length of the activations between layers for `seq_len` tokens (all of them)."""
        return seq_len

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The final norm's output h [B, S, dim] projected by the output matrix [vocab, dim] -> [B, S, vocab]."""
        return F.linear(h, weight)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross entropy of logits [B, S, V] over labels [B, S] != ignore_index, in float32 (float64 for
        float64); 0, not NaN, when every label is ignored."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1)  # [B*S, V]
        # Keeps only the float32 (float64) logits' gradient for backward, not the logits or the labels.
        return CrossEntropy.apply(logits, labels.reshape(-1), ignore_index)
