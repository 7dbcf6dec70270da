"""Mixture-of-Experts feed-forward: router, grouped experts, and the single-device dispatch/combine.

Two parts are seams that parallel code replaces, each a submodule with a fixed signature:
- `MoE.dispatcher` (`LocalDispatcher` here) takes the routed tokens to the experts and back; it mirrors
  `orangetron/parallel/expert/dispatcher.py`'s `Dispatcher` (dispatch hands each expert its token copies with
  their routing weights; combine sums a token's weighted copies), which expert parallelism puts in its place;
- `Router.aux_losses` (`RouterLosses` here) computes the auxiliary losses over the tokens this module routes;
  when ranks split the batch, `orangetron/parallel/expert/balance.py` puts the global-batch version there.

For backward a layer keeps (see `orangetron.plan.activations`): the router input, the router scores, the
top-k expert ids, the dispatched token copies, each copy's routing weight, and per copy the experts'
gate, up and weighted product; the permutations are recomputed from the top-k ids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .autograd import (
    FromExpertOrder,
    LoadBalancingLoss,
    RouterLogits,
    RouterZLoss,
    ToExpertOrder,
    TopKWeights,
    swiglu_activation,
)
from .config import ModelSpec
from .grouped_mm import grouped_mm_accepts, grouped_swiglu
from .layers import SwiGLU


def load_balancing_loss(scores: torch.Tensor, topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss `n_experts * sum_e f_e * P_e` (without the coefficient).

    scores: [T, E] router scores; topk_idx: [T, k]. f_e is the fraction of the T*k assignments routed to e
    (no gradient), P_e the mean over tokens of e's score after normalizing each token's scores to sum 1.
    Returns a 0-d tensor in scores' dtype; 0 when T == 0.
    """
    if scores.shape[0] == 0:
        return scores.new_zeros(())
    counts = torch.bincount(topk_idx.reshape(-1), minlength=n_experts)  # [E]
    f = counts.to(scores.dtype) / topk_idx.numel()
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)  # [E]
    return n_experts * (f * p).sum()


def choose_experts(scores: torch.Tensor, top_k: int, n_groups: int = 1, topk_groups: int = 1,
                   bias: torch.Tensor | None = None, group_score: str = "max") -> torch.Tensor:
    """topk_idx [T, k] int64: each token's top_k experts by `scores` [T, E] (+ `bias` [E], for choosing only).

    With n_groups > 1 the experts form n_groups groups of consecutive ids, and each token chooses only among
    the experts of its topk_groups best groups. A group's score, from the scores with the bias, is its largest
    expert score with `group_score` "max" (DeepSeek-V2 device-limited routing) or the sum of its two largest
    with "top2_sum" (DeepSeek-V3, Dots1). Equal scores go to the lower expert (group) id. No gradient: the
    weights come from the scores elsewhere.
    """
    choice = scores.detach() if bias is None else scores.detach() + bias.to(scores.dtype)  # [T, E]
    if n_groups > 1:
        tokens, experts = choice.shape
        group_score = _group_scores(choice.view(tokens, n_groups, experts // n_groups), group_score)  # [T, G]
        kept = top_indices(group_score, topk_groups)  # [T, topk_groups]
        in_kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = choice.masked_fill(~in_kept.repeat_interleave(experts // n_groups, dim=1), float("-inf"))
    return top_indices(choice, top_k)


def _group_scores(grouped: torch.Tensor, rule: str) -> torch.Tensor:
    """[T, G] scores of the groups of `grouped` [T, G, E/G] by `rule` ("max" or "top2_sum")."""
    if rule == "top2_sum":
        return grouped.topk(2, dim=-1).values.sum(-1)  # values only: which of two equal ones is taken is moot
    return grouped.amax(-1)


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] int64: the positions of the k largest of `values` [..., n] along the last dimension, equal values
    in increasing position.

    `torch.topk` leaves the order of equal values to the kernel (on CPU, of eight equal values it returns
    positions 6, 5, 4), so a tie, rare in float32 scores but possible (equal gate rows, an all-zero input),
    would route by device; a stable sort makes it a rule every device and layout shares
    (tests/test_low_precision.py).
    """
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices  # [..., n]
    return order[..., :k].contiguous()  # a copy: what keeps the ids for backward keeps k per token, not n


class RouterLosses(nn.Module):
    """A router's auxiliary losses over the tokens it routes: `aux_coef * load_balancing_loss + z_coef * z-loss`.

    forward(logits [T, E], scores [T, E], topk_idx [T, k], token_mask [T] or None, aux_coef, z_coef) -> 0-d
    tensor in the scores' dtype; padding tokens (mask False) count in neither loss.
    """

    def forward(self, logits: torch.Tensor, scores: torch.Tensor, topk_idx: torch.Tensor,
                token_mask: torch.Tensor | None, aux_coef: float, z_coef: float) -> torch.Tensor:
        aux_loss = aux_coef * LoadBalancingLoss.apply(scores, topk_idx, token_mask)
        if z_coef:
            aux_loss = aux_loss + z_coef * RouterZLoss.apply(logits, token_mask)
        return aux_loss


class Router(nn.Module):
    """Top-k router: x [T, dim] -> (topk_idx [T, k] int64, topk_weights [T, k], aux_loss 0-d).

    Scores are computed in float32 (float64 for float64 inputs) and the weights and aux loss come back in
    that dtype. The weights are the raw top-k scores (softmax probabilities or sigmoids), renormalized to sum 1
    over the top-k with `norm_topk_prob` (Mixtral, DeepSeek-V3), then multiplied by `routed_scaling_factor`
    (DeepSeek-V3, Dots1: 2.5). Group-limited routing scores groups by `group_score`. aux_loss is
    `aux_loss_coef * load_balancing_loss + router_z_loss_coef * z-loss`.
    With `router_bias_rate > 0` the buffer `expert_bias` [E] shifts the scores for choosing the top-k only,
    and `expert_load` [E] int64 counts the non-padding assignments of forwards with gradients (training,
    not evaluation) since the last bias update. A block under activation recompute routes each micro-batch
    twice, without gradients in forward and with them in backward's replay (`orangetron/parallel/recompute.py`),
    so it is counted once. The auxiliary losses come from the submodule `aux_losses`.
    """

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.score_func, self.aux_loss_coef = cfg.router_score, cfg.aux_loss_coef
        self.renormalize = cfg.norm_topk_prob  # top-k weights summing to 1
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.z_loss_coef, self.bias_rate = cfg.router_z_loss_coef, cfg.router_bias_rate
        self.n_groups, self.topk_groups, self.group_score = cfg.expert_groups, cfg.groups_per_token, cfg.group_score
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        bias = torch.zeros(cfg.num_experts) if cfg.router_bias else None
        self.register_buffer("expert_bias", bias)
        self.expert_load = torch.zeros(cfg.num_experts, dtype=torch.int64)
        self.aux_losses = RouterLosses()

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_mask: [T] bool, False for padding; padded tokens are routed but not balanced."""
        logits, scores, topk_idx, topk_weights = self.route(x, token_mask)
        aux_loss = self.aux_losses(logits, scores, topk_idx, token_mask, self.aux_loss_coef, self.z_loss_coef)
        return topk_idx, topk_weights, aux_loss

    def route(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (logits [T, E], scores [T, E], topk_idx [T, k], topk_weights [T, k]), without the
        auxiliary losses (a parallel wrapper computes them over the global batch instead)."""
        logits = RouterLogits.apply(x, self.gate.weight)  # [T, E], float32 (float64 for float64)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        topk_idx = choose_experts(scores, self.top_k, self.n_groups, self.topk_groups, self.expert_bias,
                                  self.group_score)
        if self.expert_bias is not None and torch.is_grad_enabled():  # training tokens only, not evaluation
            self._count_load(topk_idx, token_mask)
        topk_weights = TopKWeights.apply(scores, topk_idx, self.renormalize)  # [T, k]
        if self.routed_scaling_factor != 1.0:  # after the renormalization, which would undo it
            topk_weights = topk_weights * self.routed_scaling_factor
        return logits, scores, topk_idx, topk_weights

    def _count_load(self, topk_idx: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        # A scatter of the mask, where selecting the valid rows and `bincount` would each read a size from the
        # device (tests/test_host_syncs.py).
        hits = torch.ones_like(topk_idx) if token_mask is None else token_mask.long()[:, None].expand_as(topk_idx)
        load = torch.zeros_like(self.expert_load, device=topk_idx.device)
        load.scatter_add_(0, topk_idx.reshape(-1), hits.reshape(-1))
        if self.expert_load.device != load.device:  # the first count on this device
            self.expert_load = self.expert_load.to(load.device)
        self.expert_load = self.expert_load + load


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights w1, w3: [E, dim, hidden], w2: [E, hidden, dim].

    forward(x_sorted [N, dim], tokens_per_expert, weights_sorted [N] or None) -> [N, dim]: rows are grouped
    by expert, expert e owning the next tokens_per_expert[e] rows; a row's output is scaled by its weight.
    An expert-parallel shard is the same module over its local experts. In float32 and bfloat16 the three
    projections are grouped matmuls over all experts where the device takes them; otherwise (float64
    always) a loop over experts.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(0, std) for standalone use; `Transformer` re-initializes by name (`init_parameter`)."""
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=std)

    def forward(
        self, x_sorted: torch.Tensor, tokens_per_expert: list[int] | torch.Tensor,
        weights_sorted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        if len(counts) != self.w1.shape[0] or sum(counts) != x_sorted.shape[0]:
            raise ValueError(f"tokens_per_expert {counts} must have {self.w1.shape[0]} entries summing to "
                             f"the {x_sorted.shape[0]} rows of x_sorted")
        if grouped_mm_accepts(x_sorted, self.w1, self.w3, self.w2):  # float32, bf16 (`model/grouped_mm.py`)
            return grouped_swiglu(x_sorted, counts, weights_sorted, self.w1, self.w3, self.w2)
        weights = [None] * len(counts) if weights_sorted is None else torch.split(weights_sorted, counts)
        outs = []
        for e, (x_e, w_e) in enumerate(zip(torch.split(x_sorted, counts), weights, strict=True)):
            h = swiglu_activation(x_e @ self.w1[e], x_e @ self.w3[e], w_e)  # [n_e, hidden], weighted
            outs.append(h @ self.w2[e])
        return torch.cat(outs) if outs else x_sorted.new_zeros(0, x_sorted.shape[-1])


class LocalDispatcher(nn.Module):
    """Every routed token to its experts on this device and back: dispatch, the experts, combine.

    forward(x_flat [T, dim], topk_idx [T, k], topk_weights [T, k], experts, shared=None) -> [T, dim], each token
    the sum of its weighted expert outputs, plus `shared()` (the shared experts' output) when given; the signature
    of `orangetron/parallel/expert/dispatcher.py`'s `Dispatcher`, which computes `shared()` while its combine
    travels.
    """

    def forward(self, x_flat: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                experts: GroupedExperts, shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        x_sorted, weights_sorted, tokens_per_expert, handle = self.dispatch(x_flat, topk_idx, topk_weights,
                                                                            experts.w1.shape[0])
        y_sorted = experts(x_sorted, tokens_per_expert, weights_sorted)  # [T*k, dim], weighted
        y = self.combine(y_sorted, handle)  # [T, dim]
        return y if shared is None else y + shared()

    def dispatch(
        self, x_flat: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, n_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token copies grouped by expert: (x_sorted [T*k, dim], weights_sorted [T*k], tokens_per_expert
        [E], handle for `combine`). Within an expert, copies keep token order (stable sort)."""
        k = topk_idx.shape[-1]
        slots = topk_idx.reshape(-1)  # a scatter, where `bincount` would read its size from the device
        tokens_per_expert = torch.zeros(n_experts, dtype=torch.int64, device=slots.device).scatter_add_(
            0, slots, torch.ones_like(slots))
        x_sorted = ToExpertOrder.apply(x_flat, topk_idx, k)
        weights_sorted = ToExpertOrder.apply(topk_weights.reshape(-1), topk_idx, 1)
        return x_sorted, weights_sorted, tokens_per_expert, topk_idx

    def combine(self, y_sorted: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        """Sum each token's (already weighted) expert outputs: y_sorted [T*k, dim] -> [T, dim]."""
        return FromExpertOrder.apply(y_sorted, handle)


class MoE(nn.Module):
    """Routed experts plus an optional shared expert; x: [B, S, dim] -> [B, S, dim].

    With `shared_expert_gate` (Qwen2-MoE) the shared expert's output is multiplied per token by
    sigmoid(x @ w), `shared_expert_gate` a dim -> 1 linear without bias; it keeps the gate and the shared
    expert's output for backward. After each forward `last_aux_loss` holds the router's load-balancing loss
    (already scaled). The routed tokens reach the experts through the submodule `dispatcher` (a
    `LocalDispatcher` on one device).
    """

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_ffn_hidden_size) if cfg.num_shared_experts else None
        gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        self.shared_expert_gate = gate
        self.dispatcher = LocalDispatcher()
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, S, dim]; token_mask: [B, S] bool, False where the token is padding (kept out of the
        load-balancing loss so that padding never changes the loss)."""
        y, self.last_aux_loss = self.with_aux_loss(x, token_mask)
        return y

    def with_aux_loss(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """`forward` handing back (y [B, S, dim], the router's scaled auxiliary loss) instead of setting
        `last_aux_loss`: a block that replays its forward in backward (activation recompute) calls this, so that
        the replay leaves the loss the step already holds alone."""
        x_flat = x.reshape(-1, x.shape[-1])  # [T, dim]
        mask = None if token_mask is None else token_mask.reshape(-1)
        topk_idx, topk_weights, aux_loss = self.router(x_flat, mask)
        shared = None if self.shared_expert is None else partial(self.shared_output, x_flat)
        y = self.dispatcher(x_flat, topk_idx, topk_weights, self.experts, shared)  # [T, dim], shared expert added
        return y.view_as(x), aux_loss

    def shared_output(self, x_flat: torch.Tensor) -> torch.Tensor:
        """The shared expert's output [T, dim] for x_flat [T, dim], times its gate when there is one."""
        shared = self.shared_expert(x_flat)  # [T, dim]
        if self.shared_expert_gate is None:
            return shared
        return torch.sigmoid(self.shared_expert_gate(x_flat)) * shared  # [T, 1] * [T, dim]
