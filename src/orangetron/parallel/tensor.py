"""Tensor parallelism with Megatron's sequence parallelism, applied to the reference model from outside.

TP splits every weight matrix over the tp ranks (Megatron-LM, Shoeybi et al. 2019): column-parallel
projections (QKV, SwiGLU's gate and up, the vocabulary) split their output features, row-parallel ones
(attention output, SwiGLU's down) their input features, so one block needs one reduction forward and one
backward. Without sequence parallelism (SP) those are all-reduces and everything between blocks (norms,
residual adds, the router, the shared-expert gate and the routed experts) is replicated. With SP (Korthikanti
et al. 2022) the all-reduce becomes a reduce-scatter over the sequence after a block and an all-gather before
the next, so the norms run on a sequence shard and no rank keeps a duplicate activation; the gathered input
is not kept for backward: the shard is, and backward gathers it again.

Attention heads split over tp; key/value heads split too when tp divides them, and are replicated (one
per rank) when tp is a multiple of them. The embedding and the output projection split the vocabulary,
and the cross entropy runs on vocabulary shards, so no rank ever holds full-vocabulary logits. MoE routed
experts and the router stay whole on every tp rank (expert tensor parallelism 1); a shared expert splits
like a dense MLP, and its gate (Qwen2-MoE) stays whole, applied to the shared expert's reduced output.

Some gradients are partial sums over tp and are summed once per step (`sync_grads`, one all-reduce, which
`DataParallel` calls): with SP, every replicated parameter (norm weights, router, shared-expert gate, routed
experts) sees only this rank's tokens; a replicated key/value head sees only this rank's query heads; and the
QK-norm weights (replicated, with or without SP) see only this rank's heads. Query, key and value biases split
with their weights' output features.

`tensor_parallel` shards the parameters in place and puts the modules below into the reference model with
`replace_module` (`orangetron/parallel/replace.py`): `tok_embeddings`, `io`, each block's `attention` and
dense `feed_forward`, and each MoE's `shared_expert`. The root stays the reference `Transformer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from orangetron import comm
from orangetron.mesh import MeshGroup, ParallelMesh
from orangetron.model.autograd import accumulate_dtype, cross_entropy_grad_, swiglu_activation
from orangetron.model.documents import Documents
from orangetron.model.layers import attention_heads
from orangetron.model.moe import MoE
from orangetron.model.token_io import TokenIO
from orangetron.model.transformer import Transformer
from orangetron.parallel.replace import replace_module
from orangetron.spec.layout import Layout, LayoutError

if TYPE_CHECKING:
    from orangetron.parallel.data.transient import TransientPeaks


# ---- where each parameter lives ------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """How one parameter is laid out over the tp ranks.

    `dim` is the dimension split over tp (None: every rank holds the whole tensor). `copies` tp ranks in a
    row hold the same slice (key/value heads fewer than tp). `partial_grad`: this rank's gradient is a
    partial sum that the tp ranks add up before the data-parallel reduction.
    """

    dim: int | None = None
    copies: int = 1
    partial_grad: bool = False

    def slices(self, tp: int) -> int:
        return tp // self.copies

    def slice_index(self, tp_rank: int) -> int:
        return tp_rank // self.copies

    def counts_in_norm(self, tp_rank: int) -> bool:
        """Whether this rank's copy enters the global gradient norm, so each distinct element counts once."""
        if self.dim is None:
            return tp_rank == 0
        return tp_rank % self.copies == 0

    def needs_sync(self) -> bool:
        return self.partial_grad or self.copies > 1


_COLUMN = ("wq", "w1", "w3")  # split output features
_ROW = ("wo", "w2")  # split input features
_HEAD_NORMS = ("q_norm", "k_norm")  # QK-norm: one weight over head_dim, shared by every head
_REPLICATED = ("shared_expert_gate",)  # whole on every tp rank (a dim -> 1 projection), like the router


def placements(model: Transformer, tp: int, sequence_parallel: bool) -> dict[str, Placement]:
    """The `Placement` of every parameter of the reference `model` (by qualified name) on tp ranks."""
    kv_copies = max(1, tp // model.cfg.num_kv_heads)
    out = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        owner = parts[-2]
        if name in ("tok_embeddings.weight", "output.weight"):
            out[name] = Placement(dim=0)
        elif owner in _HEAD_NORMS:  # each rank normalizes its own heads: its gradient is partial even without SP
            out[name] = Placement(partial_grad=tp > 1)
        elif ".experts." in name or ".router." in name or owner in _REPLICATED or owner.endswith("norm"):
            out[name] = Placement(partial_grad=sequence_parallel and tp > 1)
        elif owner in ("wk", "wv"):
            out[name] = Placement(dim=0, copies=kv_copies)
        elif owner in _COLUMN:
            out[name] = Placement(dim=0)
        elif owner in _ROW:
            out[name] = Placement(dim=1)
        else:
            raise ValueError(f"{name}: no tensor-parallel placement known for this parameter")
    return out


def shard_tensor(full: torch.Tensor, placement: Placement, tp: int, tp_rank: int) -> torch.Tensor:
    """This tp rank's piece of the whole tensor `full` (a view; the whole tensor when replicated)."""
    if placement.dim is None or tp == 1:
        return full
    n = placement.slices(tp)
    if full.shape[placement.dim] % n:
        raise LayoutError(f"tp={tp}: dimension {placement.dim} of size {full.shape[placement.dim]} "
                          f"does not split into {n} equal slices")
    return full.chunk(n, dim=placement.dim)[placement.slice_index(tp_rank)]


def gather_tensor(local: torch.Tensor, placement: Placement, group: MeshGroup) -> torch.Tensor:
    """The whole tensor from every tp rank's piece (inverse of `shard_tensor`); no autograd."""
    if placement.dim is None or group.size == 1:
        return local
    pieces = comm.all_gather(local.detach().contiguous(), group, dim=placement.dim)
    return torch.cat(pieces.chunk(group.size, dim=placement.dim)[:: placement.copies], dim=placement.dim)


def _check_layout(model: Transformer, tp: int) -> None:
    Layout(tp=tp).validate(model.cfg)  # heads, kv heads, vocabulary and MLP widths against tp


# ---- autograd pieces -----------------------------------------------------------------------------
class _GatheredLinear(torch.autograd.Function):
    """All-gather the sequence, then project by each weight (forward); gather again, project the gradient
    back and reduce-scatter it (backward). Keeps the sequence shard for backward, not the gathered input."""

    @staticmethod
    def forward(ctx, x_shard: torch.Tensor, group: MeshGroup, dim: int, *weights: torch.Tensor):
        ctx.save_for_backward(x_shard, *weights)
        ctx.group, ctx.dim = group, dim
        x_full = comm.all_gather(x_shard, group, dim)
        return tuple(F.linear(x_full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x_shard, *weights = ctx.saved_tensors
        x_full = comm.all_gather(x_shard, ctx.group, ctx.dim)  # [.., S, dim], re-gathered
        x_rows = x_full.reshape(-1, x_full.shape[-1])
        grad_x = sum(g @ w for g, w in zip(grads, weights, strict=True))  # [.., S, dim], partial over tp
        grad_weights = [g.reshape(-1, g.shape[-1]).t() @ x_rows for g in grads]
        return comm.reduce_scatter(grad_x, ctx.group, ctx.dim), None, None, *grad_weights


def column_inputs(x: torch.Tensor, weights: list[torch.Tensor], group: MeshGroup, sp: bool) -> tuple[torch.Tensor, ...]:
    """Column-parallel projections of one input: x [.., S/tp (SP) or S, dim] -> each [.., S, out/tp]."""
    if sp and group.size > 1:
        return _GatheredLinear.apply(x, group, x.dim() - 2, *weights)
    x = comm.copy_to_group(x, group)  # backward sums the partial input gradients over tp
    return tuple(F.linear(x, w) for w in weights)


def row_output(partial: torch.Tensor, group: MeshGroup, sp: bool) -> torch.Tensor:
    """Sum a row-parallel projection's partial output over tp (SP: and keep this rank's sequence shard)."""
    if sp:
        return comm.reduce_scatter(partial, group, dim=partial.dim() - 2)
    return comm.all_reduce(partial, group)


class _VocabEmbedding(torch.autograd.Function):
    """Look up the rows of this rank's vocabulary slice (zeros elsewhere); backward adds into those rows.

    Keeps only the local ids (int64, -1 outside the slice), as large as the token ids the reference keeps.
    """

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
        local = tokens - start
        local = local.masked_fill((local < 0) | (local >= weight.shape[0]), -1)  # [B, S]
        ctx.save_for_backward(local, weight)
        return F.embedding(local.clamp(min=0), weight) * (local >= 0).unsqueeze(-1).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local, weight = ctx.saved_tensors
        rows = local.reshape(-1)
        hit = rows >= 0
        grad_weight = torch.zeros_like(weight).index_add_(0, rows[hit], grad.reshape(-1, grad.shape[-1])[hit])
        return None, grad_weight, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy over labels != ignore_index from vocabulary-sharded logits [N, V/tp].

    Two reductions over tp: the row maximum, then each row's sum of exponentials and target logit in one
    tensor. Keeps only the local logits' gradient (softmax minus one-hot, this rank's columns).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, start: int, group: MeshGroup):
        valid = labels != ignore_index  # [N]
        local = labels - start
        mine = valid & (local >= 0) & (local < logits.shape[-1])
        target_col = local.masked_fill(~mine, 0).unsqueeze(-1)  # [N, 1]
        row_max = comm.all_reduce_max(logits.max(-1, keepdim=True).values, group)  # [N, 1]
        shifted = logits - row_max
        exp = shifted.exp()
        target = shifted.gather(-1, target_col) * mine.unsqueeze(-1)  # [N, 1], nonzero on one rank
        sums = comm.all_reduce(torch.cat((exp.sum(-1, keepdim=True), target), dim=-1), group)  # [N, 2]
        log_z = sums[:, :1].log()
        n_valid = valid.sum().clamp(min=1)
        loss = ((log_z - sums[:, 1:]).squeeze(-1) * valid).sum() / n_valid
        if ctx.needs_input_grad[0]:
            # Softmax over the whole vocabulary, this rank's columns.
            grad = cross_entropy_grad_(exp.div_(sums[:, :1]), target_col, mine, valid, n_valid)
            ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None


# ---- modules -------------------------------------------------------------------------------------
class ParallelAttention(nn.Module):
    """Grouped-query attention on this rank's heads: column-parallel wq/wk/wv (and their biases, split with
    them), row-parallel wo; the QK-norms, replicated, normalize this rank's heads.

    x: [B, S/tp, dim] with SP, [B, S, dim] without; returns the same shape. The linear modules keep
    their names, so parameter names equal the reference model's; the attention core (`core_attention`, the
    seam context parallelism fills) is the reference's too.
    """

    def __init__(self, dense: nn.Module, group: MeshGroup, sp: bool) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = dense.wq, dense.wk, dense.wv, dense.wo
        self.q_norm, self.k_norm = dense.q_norm, dense.k_norm
        self.head_dim, self.core_attention = dense.head_dim, dense.core_attention
        self.group, self.sp = group, sp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        projections = (self.wq, self.wk, self.wv)
        outputs = column_inputs(x, [w.weight for w in projections], self.group, self.sp)  # each [B, S, heads/tp*D]
        # A bias is added after the gather: each rank's slice then sees the whole sequence, so its gradient is whole.
        q, k, v = (y if w.bias is None else y + w.bias for y, w in zip(outputs, projections, strict=True))
        q, k, v = attention_heads(q, k, v, self.head_dim, cos, sin, self.q_norm, self.k_norm)  # [B, S, H/tp, D]
        b, s = q.shape[:2]
        # [B, S, Hq/tp, D]; packed rows attend within their documents (every rank holds the whole sequence)
        out = self.core_attention(q, k, v) if documents is None else self.core_attention(q, k, v, documents)
        return row_output(F.linear(out.reshape(b, s, -1), self.wo.weight), self.group, self.sp)


class ParallelSwiGLU(nn.Module):
    """SwiGLU split on its hidden dimension: w1, w3 column-parallel, w2 row-parallel.

    x: [..., S/tp or S, dim] (the second-to-last dimension is the one SP shards) -> the same shape.
    """

    def __init__(self, dense: nn.Module, group: MeshGroup, sp: bool) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = dense.w1, dense.w3, dense.w2
        self.group, self.sp = group, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_inputs(x, [self.w1.weight, self.w3.weight], self.group, self.sp)
        return row_output(F.linear(swiglu_activation(gate, up), self.w2.weight), self.group, self.sp)


def refuse_outside_vocab(ids: torch.Tensor, vocab: int, what: str, ignore_index: int | None = None) -> None:
    """IndexError for an id outside [0, vocab) (but `ignore_index`), as one rank's embedding and cross entropy
    raise: sharded over the vocabulary, every rank would only find it off its slice, and a wrong output would
    follow unsaid. On a GPU the check runs on the device, without waiting for it."""
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if ids.device.type != "cpu":
        torch._assert_async(~bad.any(), f"a {what} lies outside the vocabulary [0, {vocab})")
    elif bad.any():
        raise IndexError(f"{what} {int(ids[bad][0])} lies outside the vocabulary [0, {vocab})")


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary: tokens [B, S] -> [B, S/tp, dim] (SP) or [B, S, dim]."""

    def __init__(self, dense: nn.Embedding, group: MeshGroup, sp: bool) -> None:
        super().__init__()
        self.weight = dense.weight
        self.start = group.rank * dense.weight.shape[0]
        self.group, self.sp = group, sp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if self.sp and seq_len % self.group.size:
            raise LayoutError(f"tp={self.group.size}: sequence_parallel needs seq_len {seq_len} divisible by tp")
        refuse_outside_vocab(tokens, self.weight.shape[0] * self.group.size, "token id")
        partial = _VocabEmbedding.apply(tokens, self.weight, self.start)  # [B, S, dim], zeros off-slice
        return row_output(partial, self.group, self.sp)


class TensorParallelIO(TokenIO):
    """`TokenIO` on one tp rank: logits and cross entropy on this rank's vocabulary slice; under SP the
    activations between layers (and so the routers' padding mask) are this rank's sequence shard."""

    def __init__(self, group: MeshGroup, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = group, sp

    def routing_mask(self, token_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask [B, S] of the tokens this rank routes: its sequence shard under SP."""
        if not self.sp or token_mask is None:
            return token_mask
        # A copy, so the load-balancing loss keeps this shard, not the whole mask.
        return token_mask.chunk(self.group.size, dim=1)[self.group.rank].contiguous()

    def hidden_len(self, seq_len: int) -> int:
        """S/tp under SP, else S."""
        return seq_len // self.group.size if self.sp else seq_len

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """h [B, S/tp or S, dim], this rank's vocabulary slice of the output matrix -> [B, S, vocab/tp]."""
        (logits,) = column_inputs(h, [weight], self.group, self.sp)
        return logits

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Vocabulary-parallel mean cross entropy: logits [B, S, V/tp], labels [B, S]."""
        logits = logits.to(accumulate_dtype(logits.dtype)).flatten(0, 1)  # [B*S, V/tp]
        start = self.group.rank * logits.shape[-1]
        refuse_outside_vocab(labels, logits.shape[-1] * self.group.size, "label", ignore_index)
        return _VocabParallelCrossEntropy.apply(logits, labels.reshape(-1), ignore_index, start, self.group)


def tp_placements(model: nn.Module) -> dict[str, Placement] | None:
    """The `Placement` of every parameter of `model` by name when `tensor_parallel` sharded it (its `io` is a
    `TensorParallelIO`); None for a model every tp rank holds whole."""
    io = getattr(model, "io", None)
    if not isinstance(io, TensorParallelIO):
        return None
    return placements(model, io.group.size, io.sp)


def sync_grads(model: nn.Module, by_name: dict[str, Placement], group: MeshGroup,
               transient: TransientPeaks | None = None) -> None:
    """Sum the partial gradients of `model` over tp (see the module docstring): one all-reduce of all of them.
    Their concatenation and the sum count in `transient`'s `grad_buckets` while they exist."""
    pieces = [(p, by_name[n]) for n, p in model.named_parameters()
              if by_name[n].needs_sync() and p.grad is not None]
    if not pieces or group.size == 1:
        return
    flat = torch.cat([_sync_slots(p.grad, pl, group) for p, pl in pieces])
    nbytes = 2 * flat.numel() * flat.element_size()  # the concatenation and the all-reduce's sum
    if transient is not None:
        transient.add("grad_buckets", nbytes)
    flat = comm.all_reduce(flat, group)
    offset = 0
    for p, pl in pieces:
        width = p.numel() * (pl.slices(group.size) if pl.copies > 1 else 1)
        summed = flat[offset:offset + width]
        if pl.copies > 1:
            summed = summed.view(pl.slices(group.size), -1)[pl.slice_index(group.rank)]
        p.grad.copy_(summed.view_as(p.grad))
        offset += width
    if transient is not None:
        transient.add("grad_buckets", -nbytes)


def _sync_slots(grad: torch.Tensor, placement: Placement, group: MeshGroup) -> torch.Tensor:
    """A gradient laid out for the tp sum: as is, or (replicated kv heads) in its slot of all the slices,
    so that the sum adds up exactly the ranks holding the same slice."""
    if placement.copies == 1:
        return grad.reshape(-1)
    slots = grad.new_zeros(placement.slices(group.size), grad.numel())
    slots[placement.slice_index(group.rank)] = grad.reshape(-1)
    return slots.reshape(-1)


@torch.no_grad()
def _shard_parameters(model: Transformer, by_name: dict[str, Placement], group: MeshGroup) -> None:
    for name, p in model.named_parameters():
        p.data = shard_tensor(p.data, by_name[name], group.size, group.rank).clone()


def tensor_parallel(model: Transformer, mesh: ParallelMesh, sequence_parallel: bool = False) -> Transformer:
    """Shard the reference `model` in place over `mesh["tp"]`; returns `model`.

    Afterwards forward(tokens [B, S]) gives this rank's vocabulary slice of the logits, [B, S, vocab/tp], every
    tp rank getting the whole sequence; `loss_from_logits` is the vocabulary-parallel cross entropy (plus the
    MoE load-balancing loss, computed per rank over the tokens it routes: its sequence shard under SP).
    Parameter names stay the reference's.
    """
    group = mesh["tp"]
    _check_layout(model, group.size)
    sp = sequence_parallel and group.size > 1
    _shard_parameters(model, placements(model, group.size, sequence_parallel), group)
    replace_module(model, "tok_embeddings", VocabParallelEmbedding(model.tok_embeddings, group, sp))
    replace_module(model, "io", TensorParallelIO(group, sp))
    for i, block in enumerate(model.layers):
        replace_module(model, f"layers.{i}.attention", ParallelAttention(block.attention, group, sp))
        ff = block.feed_forward
        if not isinstance(ff, MoE):
            replace_module(model, f"layers.{i}.feed_forward", ParallelSwiGLU(ff, group, sp))
        elif ff.shared_expert is not None:
            replace_module(model, f"layers.{i}.feed_forward.shared_expert", ParallelSwiGLU(ff.shared_expert, group, sp))
    return model
