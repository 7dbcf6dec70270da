"""Memory categories a rank keeps, as the runtime measures them and the cost model predicts them."""

from __future__ import annotations

CATEGORIES = ("params", "grads", "main_params", "optimizer", "activations")
# Buffers that exist only during a step (their peak): ZeRO-3's gathered units, the reduction's buffers, and the
# per-parameter `.grad` tensors autograd fills before they reach the flat buffers (`plan/param_grads.py`).
TRANSIENT = ("gathered_params", "grad_buckets", "param_grads")
# The tensors an estimate reports per GPU: the measured categories, the transient buffers' sum and FP8's weight
# copies (the overhead term comes on top: plan/overhead.py).
ESTIMATED_TENSORS = (*CATEGORIES, "buffers", "fp8")
