"""The built-in context-parallel attention modes, each one record: runtime module, traffic, saved bytes.

Traffic is per layer and micro-batch, forward (`passes` of it: 2 under full recompute) plus backward, as
the runtime's ledger records it (parallel/context/):
- ring passes K,V cp-1 times per forward and in backward, and dK,dV cp hops home;
- rsa (ring self-attention, ColossalAI) runs K and V in rings of their own and keeps its [s/cp, s]
  probabilities instead of the kernel's log-sum-exp;
- allgather gathers K,V per forward and again in backward, and reduce-scatters dK,dV;
- ulysses all-to-alls Q, K+V (kv heads replicated up to one per rank) and the output, forward and backward;
- usp runs Ulysses over `ulysses_degree` consecutive cp ranks and a ring of the gathered K,V over the rest.
"""

from __future__ import annotations

from typing import Any

from orangetron.spec.collectives import CommRecord, all_to_all_record, gather_record, send_recv_records
from orangetron.spec.variants import CONTEXT_MODES, ContextMode


def kv_bytes(model: Any, deg: Any, job: Any, heads: int | None = None, dim: int | None = None) -> int:
    """K and V (or `dim` per head) of this rank's tokens and kv heads (`heads`, default the tp share)."""
    heads = max(1, model.kv_heads // deg.tp) if heads is None else heads
    tokens = (job.seq_len // deg.cp) * job.micro_batch
    return job.param_bytes * tokens * heads * ((model.qk_head_dim + model.v_dim) if dim is None else dim)


def ulysses_kv_heads(model: Any, deg: Any, degree: int | None = None) -> int:
    """KV heads a rank sends into Ulysses' all-to-all over `degree` ranks (default cp): its own, or one per
    rank when it has fewer."""
    return max(max(1, model.kv_heads // deg.tp), deg.cp if degree is None else degree)


def _ring_records(model: Any, deg: Any, job: Any, passes: int) -> list[CommRecord]:
    c = deg.cp
    return send_recv_records("cp", kv_bytes(model, deg, job), (c - 1) * (passes + 1) + c)


def _rsa_records(model: Any, deg: Any, job: Any, passes: int) -> list[CommRecord]:
    c = deg.cp
    k, v = (kv_bytes(model, deg, job, dim=d) for d in (model.qk_head_dim, model.v_dim))
    rings = (c - 1) * (passes + 1)
    return (send_recv_records("cp", k, rings) + send_recv_records("cp", v, rings)
            + send_recv_records("cp", k, c) + send_recv_records("cp", v, c))


def _allgather_records(model: Any, deg: Any, job: Any, passes: int) -> list[CommRecord]:
    c = deg.cp
    gathered = kv_bytes(model, deg, job) * c
    return [gather_record("all_gather", "cp", gathered, c)] * (passes + 1) + \
        [gather_record("reduce_scatter", "cp", gathered, c)]


def _ulysses_records(model: Any, deg: Any, job: Any, passes: int, u: int, dim: str) -> list[CommRecord]:
    """Ulysses over u ranks: sequence shards <-> head shards for Q, K+V and the output. USP then passes the
    gathered K,V around a ring over the other c/u ranks (the same bytes per hop as sent into the all-to-all)."""
    c = deg.cp
    tokens = (job.seq_len // c) * job.micro_batch
    heads = model.num_heads // deg.tp
    q = job.param_bytes * tokens * heads * model.qk_head_dim
    o = job.param_bytes * tokens * heads * model.v_dim
    kv = kv_bytes(model, deg, job, heads=ulysses_kv_heads(model, deg, u))
    out = [all_to_all_record(dim, q, u), all_to_all_record(dim, kv, u), all_to_all_record(dim, o, u)] * (passes + 1) \
        if u > 1 else []
    r = c // u
    return out + (send_recv_records("cp_ring", kv, (r - 1) * (passes + 1) + r) if r > 1 else [])


def _head_shard_bytes(model: Any, x: Any, heads: int, kv: int, degree: int) -> int:
    """Ulysses' core keeps the head-sharded output besides the sequence-sharded one the projection keeps, and
    kv heads fewer than the Ulysses degree arrive one per rank."""
    if degree == 1:
        return 0
    kv_sent = max(kv, degree)
    return x.a * x.s * x.b * (heads * model.v_dim + (kv_sent - kv) * (model.qk_head_dim + model.v_dim))


CONTEXT_MODES.register(ContextMode(
    name="ring", summary="K,V blocks around the ring, overlapped with the block at hand",
    runtime="orangetron.parallel.context.ring", records=_ring_records, key_blocks=lambda deg, job: deg.cp,
    packed_ring=lambda deg, job: (1, "cp")))
CONTEXT_MODES.register(ContextMode(
    name="allgather", summary="K,V gathered once (again in backward), dK,dV reduce-scattered",
    runtime="orangetron.parallel.context.allgather", records=_allgather_records))
CONTEXT_MODES.register(ContextMode(
    name="ulysses", summary="all-to-all between sequence and head shards (DeepSpeed-Ulysses)",
    runtime="orangetron.parallel.context.ulysses",
    records=lambda model, deg, job, passes: _ulysses_records(model, deg, job, passes, deg.cp, "cp"),
    saved_bytes=lambda model, x, job, heads, kv: _head_shard_bytes(model, x, heads, kv, x.s_kv // x.s),
    head_split=lambda cp, ulysses_degree: cp))
CONTEXT_MODES.register(ContextMode(
    name="usp", summary="Ulysses over --ulysses-degree consecutive ranks x a ring over the rest",
    runtime="orangetron.parallel.context.usp",
    records=lambda model, deg, job, passes: _ulysses_records(model, deg, job, passes, job.ulysses_degree,
                                                             "cp_ulysses"),
    saved_bytes=lambda model, x, job, heads, kv: _head_shard_bytes(model, x, heads, kv, job.ulysses_degree),
    head_split=lambda cp, ulysses_degree: ulysses_degree, searched=False,
    key_blocks=lambda deg, job: deg.cp // job.ulysses_degree,
    subgroups=lambda deg, job: {"cp_ulysses": (job.ulysses_degree, 1),
                                "cp_ring": (deg.cp // job.ulysses_degree, job.ulysses_degree)},
    takes_ulysses_degree=True, packed_ring=lambda deg, job: (job.ulysses_degree, "cp_ring")))
CONTEXT_MODES.register(ContextMode(
    name="rsa", summary="ring self-attention: K then V around the ring, [L, S] probabilities kept (ColossalAI)",
    runtime="orangetron.parallel.context.rsa", records=_rsa_records,
    saved_bytes=lambda model, x, job, heads, kv: x.acc * x.b * heads * x.s * x.s_kv, keeps_kernel_state=False,
    searched=False,
    key_blocks=lambda deg, job: deg.cp))
