"""Variants registered from outside the package, through the plugin hook (ORANGETRON_PLUGINS=variants_plugin).

Each is a real variant, with a runtime and a cost of its own that differs from every built-in one's:
- cp mode "allgather-split": all-gathers K and V in two collectives and keeps the gathered K,V for backward
  (no second gather; their gradients go home by autograd's reduce-scatters);
- dispatcher "allgather-fixed": allgather dispatch without the token-count exchange (every rank routes the
  same number of tokens, as a fixed batch does);
- schedule "eager-1f1b": 1F1B with one more warmup forward per rank (its in-flight count is read off its
  action lists by the planner).
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.spec.collectives import gather_record
from orangetron.spec.context_modes import kv_bytes
from orangetron.spec.schedule import one_forward_one_backward_rank
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES, ContextMode, Dispatcher, Schedule


# ---- cp mode: allgather-split --------------------------------------------------------------------------
def _split_records(model, deg, job, passes):
    c = deg.cp
    k, v = (kv_bytes(model, deg, job, dim=d) * c for d in (model.qk_head_dim, model.v_dim))
    return [gather_record("all_gather", "cp", k, c), gather_record("all_gather", "cp", v, c)] * passes + \
        [gather_record("reduce_scatter", "cp", k, c), gather_record("reduce_scatter", "cp", v, c)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool, scale: float,
              impl: str = "fused") -> torch.Tensor:
    """K and V gathered apart, then one block over the whole sequence, kept for backward."""
    from orangetron.parallel.context.blocks import PositionalAttention

    seq_len = q.shape[1] * group.size
    k_all, v_all = comm.all_gather(k, group, dim=1), comm.all_gather(v, group, dim=1)  # [B, S, Hk, D]
    return PositionalAttention.apply(q, k_all, v_all, (seq_len, group.size, group.rank),
                                     (seq_len, group.size, None), causal, scale, impl)


CONTEXT_MODES.register(ContextMode(
    name="allgather-split", summary="test plugin: K and V gathered apart and kept",
    runtime="variants_plugin", records=_split_records,
    # the gathered K,V stay: cp - 1 more shards of both beyond this rank's own
    saved_bytes=lambda model, x, job, heads, kv: x.a * x.b * (x.s_kv - x.s) * kv * (model.qk_head_dim + model.v_dim)))


# ---- dispatcher: allgather-fixed -----------------------------------------------------------------------
def _fixed_records(model, deg, job, tokens):
    e, k = deg.ep, model.top_k
    row, ids, weights = job.param_bytes * model.hidden_size, 8 * k, (8 if job.param_bytes == 8 else 4) * k
    forward = [gather_record("all_gather", "ep", e * tokens * b, e) for b in (row, ids, weights)]
    forward += [gather_record("reduce_scatter", "ep", e * tokens * row, e)]
    backward = [gather_record("reduce_scatter", "ep", e * tokens * b, e) for b in (row, weights)]
    return forward * (2 if job.recompute == "full" else 1) + backward + \
        [gather_record("all_gather", "ep", e * tokens * row, e)]


class FixedDispatch:
    """The runtime module's two functions, as an object the record's import path names."""

    @staticmethod
    def dispatch(x, topk_idx, topk_weights, group, num_experts, options=None):
        from orangetron.parallel.expert.allgather import AllGatherHandle
        from orangetron.parallel.expert.routing import tokens_per_local_expert

        tokens, local = x.shape[0], num_experts // group.size
        gathered_x = comm.all_gather(x, group)  # [ep * T, dim]
        gathered_idx, gathered_w = comm.all_gather(topk_idx, group), comm.all_gather(topk_weights, group)
        here = gathered_idx // local == group.rank
        keep = here.any(1).nonzero().squeeze(1)
        recv_idx = torch.where(here, gathered_idx - group.rank * local, -1)[keep]
        recv_w = torch.where(here, gathered_w, torch.zeros_like(gathered_w))[keep]
        return gathered_x[keep], recv_idx, recv_w, tokens_per_local_expert(recv_idx, local), \
            AllGatherHandle(keep, tokens, tokens)

    @staticmethod
    def combine(expert_out, handle, group):
        from orangetron.parallel.expert import allgather

        return allgather.combine(expert_out, handle, group)


DISPATCHERS.register(Dispatcher(
    name="allgather-fixed", summary="test plugin: allgather without the count exchange",
    runtime="variants_plugin:FixedDispatch", records=_fixed_records,
    mask_bytes=lambda model, tokens, job, ep, rows: ep * tokens * model.top_k))


# ---- schedule: eager-1f1b ------------------------------------------------------------------------------
def _eager_actions(pp, m, v):
    return [one_forward_one_backward_rank(m, warmup=min(pp - r, m), chunks=1, pp=pp) for r in range(pp)]


SCHEDULES.register(Schedule(
    name="eager-1f1b", summary="test plugin: 1F1B with one more warmup forward",
    runtime="orangetron.parallel.pipeline.executor:run_pipeline", actions=_eager_actions))
