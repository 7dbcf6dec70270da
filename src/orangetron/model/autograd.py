"""Memory-lean autograd Functions: each keeps for backward exactly what the planner counts.

`orangetron.plan.activations` predicts the bytes saved for backward and `orangetron.memory` measures them;
the two agree exactly because these Functions save only the tensors a lean implementation needs and
recompute the rest (RMSNorm's 1/rms, SiLU, the expert permutation) in backward. Each has a float64
gradcheck in tests/test_plan_activations_exact.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs (and float32), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight forward; backward recomputes 1/rms from the saved x (saves x and weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        normed, _ = _rms_normed(x, eps)
        return normed.to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        normed, rstd = _rms_normed(x, ctx.eps)  # [..., dim], [..., 1] in the accumulate dtype
        grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0, dtype=normed.dtype)
        g = (grad * weight).to(normed.dtype)
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def _rms_normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(accumulate_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


class SwiGLUActivation(torch.autograd.Function):
    """silu(gate) * up, optionally times a per-row weight; saves gate, up (and the weight), not silu(gate).

    The row weight is an expert copy's routing weight: applying it to the hidden product (the down
    projection's input, which the matmul keeps anyway) gives its gradient without keeping the expert's
    output.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up, row_weight)
        hidden = F.silu(gate) * up  # [N, f]
        if row_weight is not None:
            hidden = hidden * row_weight.to(hidden.dtype).unsqueeze(-1)
        return hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, row_weight = ctx.saved_tensors
        acc = accumulate_dtype(gate.dtype)
        g, u, dy = gate.to(acc), up.to(acc), grad.to(acc)
        sig = torch.sigmoid(g)
        silu = g * sig
        grad_weight = None
        if row_weight is not None:
            grad_weight = (dy * silu * u).sum(-1).to(row_weight.dtype)
            dy = dy * row_weight.to(acc).unsqueeze(-1)
        grad_gate = dy * u * sig * (1 + g * (1 - sig))
        return grad_gate.to(gate.dtype), (dy * silu).to(up.dtype), grad_weight


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up [* row_weight[:, None]]`; gate, up: [..., f], row_weight: [N] for gate [N, f]."""
    return SwiGLUActivation.apply(gate, up, row_weight)


class CPUFlashAttention(torch.autograd.Function):
    """PyTorch's CPU flash-attention op forward and its backward op; saves q, k, v (kv heads not expanded),
    out and lse, and sums the expanded heads' key/value gradients back onto their kv head."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
        hq = q.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), expand_kv(k, hq).transpose(1, 2), expand_kv(v, hq).transpose(1, 2), 0.0, causal,
            scale=scale)
        out = out.transpose(1, 2)  # [B, Sq, Hq, D]; the op lays its output out this way, so no copy
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        (b, sk, hk, d), hq = k.shape, q.shape[2]
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), expand_kv(k, hq).transpose(1, 2),
            expand_kv(v, hq).transpose(1, 2), out.transpose(1, 2), lse, 0.0, ctx.causal, scale=ctx.scale)
        grad_k = grad_k.transpose(1, 2).reshape(b, sk, hk, hq // hk, d).sum(3)  # [B, Sk, Hk, D]
        grad_v = grad_v.transpose(1, 2).reshape(b, sk, hk, hq // hk, d).sum(3)
        return grad_q.transpose(1, 2), grad_k, grad_v, None, None


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, S, Hk, D] -> [B, S, n_heads, D], each kv head repeated for its group of query heads."""
    b, s, hk, d = x.shape
    if hk == n_heads:
        return x
    return x[:, :, :, None, :].expand(b, s, hk, n_heads // hk, d).reshape(b, s, n_heads, d)


def expert_order(topk_idx: torch.Tensor) -> torch.Tensor:
    """[T*k] copy slots (token * k + j) sorted by expert, token order kept within an expert (stable)."""
    return torch.argsort(topk_idx.reshape(-1), stable=True)


class ToExpertOrder(torch.autograd.Function):
    """Gather rows into expert order forward (each row `copies` times), sum the copies backward.

    Saves only topk_idx (which top-k keeps anyway) and recomputes the permutation in backward.
    """

    @staticmethod
    def forward(ctx, src: torch.Tensor, topk_idx: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(topk_idx)
        ctx.copies = copies
        return src[expert_order(topk_idx) // copies]  # [T*k, ...]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (topk_idx,) = ctx.saved_tensors
        order = expert_order(topk_idx)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # A permutation gather then a sum over copies, instead of index_add: bitwise deterministic on GPUs.
        return grad[inverse].view(-1, ctx.copies, *grad.shape[1:]).sum(1), None, None


class FromExpertOrder(torch.autograd.Function):
    """Sum each token's k expert-ordered rows forward, gather them back to expert order backward.

    Saves only topk_idx.
    """

    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(topk_idx)
        order = expert_order(topk_idx)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return y_sorted[inverse].view(-1, topk_idx.shape[-1], y_sorted.shape[-1]).sum(1)  # [T, dim]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (topk_idx,) = ctx.saved_tensors
        return grad[expert_order(topk_idx) // topk_idx.shape[-1]], None


class RouterLogits(torch.autograd.Function):
    """x @ weight.T with the products summed in float32 (float64 for float64), returned in that dtype.

    A 16-bit linear would round every logit to 8 significant bits, so experts within 2^-8 of each other in
    logit would tie or swap; summed in float32, only true near-ties can (tests/test_low_precision.py).
    Saves x and the weight, as an `nn.Linear` does.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        acc = accumulate_dtype(x.dtype)
        return x.to(acc) @ weight.to(acc).t()  # [T, E]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        acc = grad.dtype
        grad_x = grad @ weight.to(acc)  # [T, dim]
        grad_weight = grad.t() @ x.to(acc)  # [E, dim]
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


class TopKWeights(torch.autograd.Function):
    """scores.gather(-1, topk_idx), renormalized to sum 1 per token if `normalize`.

    Saves only the scores and topk_idx, which the router's softmax/sigmoid and the dispatch keep anyway.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, topk_idx: torch.Tensor, normalize: bool) -> torch.Tensor:
        ctx.save_for_backward(scores, topk_idx)
        ctx.normalize = normalize
        weights = scores.gather(-1, topk_idx)  # [T, k]
        return weights / weights.sum(-1, keepdim=True) if normalize else weights

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scores, topk_idx = ctx.saved_tensors
        if ctx.normalize:
            picked = scores.gather(-1, topk_idx)
            total = picked.sum(-1, keepdim=True)
            grad = (grad - (grad * picked).sum(-1, keepdim=True) / total) / total
        return torch.zeros_like(scores).scatter_add_(-1, topk_idx, grad), None, None


class LoadBalancingLoss(torch.autograd.Function):
    """`load_balancing_loss` over the tokens where token_mask is True (all when None).

    Saves the scores, topk_idx and the mask, all kept anyway or shared by every layer; recomputes the
    expert fractions f in backward. Padding weighs 0 in every sum rather than being cut out, so no size is read
    from the device (tests/test_host_syncs.py).
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, topk_idx: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(scores, topk_idx, token_mask)
        if scores.shape[0] == 0:
            return scores.new_zeros(())
        valid = _valid(scores, token_mask)  # [T]
        n = valid.sum()
        f = _expert_fractions(topk_idx, valid, n, scores.shape[1])
        p = (scores / scores.sum(-1, keepdim=True) * valid[:, None]).sum(0) / n.clamp(min=1)  # [E]
        return scores.shape[1] * (f * p).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scores, topk_idx, token_mask = ctx.saved_tensors
        valid = _valid(scores, token_mask)
        n = valid.sum()
        f = _expert_fractions(topk_idx, valid, n, scores.shape[1])  # [E]
        total = scores.sum(-1, keepdim=True)  # [T, 1]
        # d/ds[t, e] of E/n * sum_e' f_e' s[t, e'] / S_t = E/n * (f_e - sum_e' f_e' s[t, e'] / S_t) / S_t
        scale = grad * scores.shape[1] / n.clamp(min=1)
        grad_scores = (f - (scores * f).sum(-1, keepdim=True) / total) / total * scale
        if token_mask is not None:
            grad_scores = grad_scores * token_mask.unsqueeze(-1)
        return grad_scores, None, None


class RouterZLoss(torch.autograd.Function):
    """ST-MoE z-loss: mean over the tokens where token_mask is True of logsumexp(logits)^2 (0 when none).

    Saves the logits (and the mask, shared by every layer); recomputes logsumexp and softmax in backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(logits, token_mask)
        valid = _valid(logits, token_mask)  # [T]
        return (logits.logsumexp(-1).square() * valid).sum() / valid.sum().clamp(min=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, token_mask = ctx.saved_tensors
        n_valid = _valid(logits, token_mask).sum()
        return z_loss_grad(logits, token_mask, grad / n_valid.clamp(min=1)), None


def _valid(like: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """[T] in `like`'s dtype: 1 for a token that counts, 0 for padding."""
    return like.new_ones(like.shape[0]) if token_mask is None else token_mask.to(like.dtype)


def z_loss_grad(logits: torch.Tensor, token_mask: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """d/dlogits of scale * sum_t lse_t^2 over the unmasked tokens: 2 * lse_t * softmax(logits_t) * scale."""
    lse = logits.logsumexp(-1, keepdim=True)  # [T, 1]
    grad = 2 * lse * (logits - lse).exp() * scale  # [T, E]
    return grad if token_mask is None else grad * token_mask.unsqueeze(-1)


def _expert_fractions(topk_idx: torch.Tensor, valid: torch.Tensor, n: torch.Tensor, experts: int) -> torch.Tensor:
    """[E]: the fraction of the n valid tokens' assignments routed to each expert (padding weighs 0)."""
    weights = valid[:, None].expand_as(topk_idx).reshape(-1)
    counts = valid.new_zeros(experts).scatter_add_(0, topk_idx.reshape(-1), weights)
    return counts / (n * topk_idx.shape[1]).clamp(min=1)


class CrossEntropy(torch.autograd.Function):
    """Mean cross entropy over labels != ignore_index that computes the logits' gradient in its forward.

    It keeps only that gradient (softmax minus one-hot, in the logits' dtype), as large as the logits,
    and no labels; all-ignored labels give 0.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        valid = labels != ignore_index  # [N]
        target = labels.masked_fill(~valid, 0).unsqueeze(-1)  # [N, 1]
        # Everything from logits shifted by their row maximum, as the vocabulary-parallel cross entropy
        # (orangetron/parallel/tensor.py): exp cannot overflow, and the loss log(sum) - shifted target is
        # formed from small numbers, so its rounding error scales with the loss, not with the logits (an
        # lse of magnitude 1e4 rounded to float32 alone is off by 5e-4; tests/test_low_precision.py).
        shifted = logits - logits.amax(-1, keepdim=True)  # [N, V], <= 0
        target_logit = shifted.gather(-1, target)  # [N, 1]
        probs = shifted.exp_()  # unnormalized, in place: nothing else reads the shifted logits
        sums = probs.sum(-1, keepdim=True)  # [N, 1], in [1, V]
        n_valid = valid.sum().clamp(min=1)
        loss = ((sums.log() - target_logit).squeeze(-1) * valid).sum() / n_valid
        if not ctx.needs_input_grad[0]:  # evaluation: no gradient to prepare
            return loss
        grad = cross_entropy_grad_(probs.div_(sums), target, valid, valid, n_valid)  # [N, V]
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None


def cross_entropy_grad_(probs: torch.Tensor, target: torch.Tensor, hit: torch.Tensor, valid: torch.Tensor,
                        n_valid: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy's gradient from softmax `probs` [N, V], in place: minus one at `target` [N, 1]
    where `hit` (the target's column is in `probs`), then each row times valid / n_valid."""
    probs.scatter_add_(-1, target, -hit.unsqueeze(-1).to(probs.dtype))
    return probs.mul_((valid.to(probs.dtype) / n_valid).unsqueeze(-1))  # 1/n in float32 would be off by 1e-8
