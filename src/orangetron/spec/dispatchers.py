"""The built-in expert dispatchers, each one record: runtime module, traffic, what it keeps for backward.

Traffic is per MoE layer and micro-batch, as `parallel.expert.Dispatcher` issues it, with balanced routing:
a row is one token for one destination rank, each token's top_k experts lie on `model.routed_ranks(ep)` ranks
(min(top_k, ep) without group-limited routing), and every rank receives as many rows as it sends.
- ragged: the counts (1 + E/ep int64 per peer: the rows, then the assignments to each of the peer's experts,
  so one host read sizes the rows and the experts' groups), then the rows, their local expert ids (int64) and
  routing weights (float32, float64 for float64) forward; backward returns the rows' and weights' gradients;
  the combine sends the outputs back and its backward the gradients out again. With `ep_overlap_chunks` c:
  one count exchange of c * (1 + E/ep) int64 per peer, then the row records once per token chunk.
- capacity: ragged's, with every destination padded to min(E/ep * capacity, tokens) rows, capacity =
  ceil(tokens * top_k / E * capacity_factor).
- allgather: the counts (1 + ep + E int64 per rank: its tokens, its rows per rank, its assignments per
  expert), then tokens, ids and weights gathered forward and reduce-scattered backward (tokens and weights);
  the combine reduce-scatters the outputs and its backward gathers again.
- deepep (planner only): a token crosses to each remote node once, then NVLink; priced from the EP group's
  placement on nodes (plan/node_dispatch.py), so its record carries no records of its own.
"""

from __future__ import annotations

import math
from typing import Any

from orangetron.spec.collectives import CommRecord, all_to_all_record, gather_record
from orangetron.spec.sharding import token_chunks
from orangetron.spec.variants import DISPATCHERS, Dispatcher


def slots_per_expert(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """ceil(tokens * top_k / experts * factor), and no more than the tokens, of which an expert takes each once
    at most: from the factor experts / top_k up, every token keeps its experts (and a factor of 1e305 is not
    multiplied out, where it would overflow). The runtime's and the planner's one formula."""
    if factor >= experts / top_k:
        return tokens
    return math.ceil(tokens * top_k / experts * factor)  # below tokens: the product is under tokens


def capacity_slots(model: Any, tokens: int, job: Any) -> int:
    """Slots per expert for one rank's `tokens` (the runtime's `parallel.expert.capacity.capacity`)."""
    return slots_per_expert(tokens, model.top_k, model.num_experts, job.capacity_factor)


def _capacity_rows(model: Any, tokens: int, job: Any, ep: int) -> int:
    return min(model.num_experts // ep * capacity_slots(model, tokens, job), tokens) * ep


def _row_sizes(model: Any, job: Any) -> tuple[int, int, int]:
    """Bytes per row of (a token, its expert ids, its routing weights)."""
    k = model.top_k
    return job.param_bytes * model.hidden_size, 8 * k, (8 if job.param_bytes == 8 else 4) * k


def count_exchange_bytes(model: Any, ep: int, chunks: int = 1) -> int:
    """Payload of the all-to-all dispatchers' count exchange: per peer and token chunk, the rows and the
    assignments to each of the peer's E/ep experts (int64)."""
    return 8 * ep * chunks * (1 + model.num_experts // ep)


def _all_to_all_records(rows_of: Any) -> Any:
    """Records of a dispatcher that all-to-alls `rows_of(model, tokens, job, ep)` rows per token chunk."""

    def records(model: Any, deg: Any, job: Any, tokens: int) -> list[CommRecord]:
        e = deg.ep
        row, ids, weights = _row_sizes(model, job)
        chunk_rows = [rows_of(model, n, job, e) for n in token_chunks(tokens, job.ep_overlap_chunks)]
        forward = [all_to_all_record("ep", count_exchange_bytes(model, e, len(chunk_rows)), e)]
        forward += [all_to_all_record("ep", rows * b, e) for rows in chunk_rows for b in (row, ids, weights, row)]
        backward = [all_to_all_record("ep", rows * b, e) for rows in chunk_rows for b in (row, weights, row)]
        return forward * (2 if job.recompute == "full" else 1) + backward

    return records


def _allgather_records(model: Any, deg: Any, job: Any, tokens: int) -> list[CommRecord]:
    e = deg.ep
    row, ids, weights = _row_sizes(model, job)
    forward = [gather_record("all_gather", "ep", 8 * e * (1 + e + model.num_experts), e)]  # the counts
    forward += [gather_record("all_gather", "ep", e * tokens * b, e) for b in (row, ids, weights)]
    forward += [gather_record("reduce_scatter", "ep", e * tokens * row, e)]  # combine
    backward = [gather_record("reduce_scatter", "ep", e * tokens * b, e) for b in (row, weights)]
    return forward * (2 if job.recompute == "full" else 1) + backward + \
        [gather_record("all_gather", "ep", e * tokens * row, e)]


def _ragged_rows(model: Any, tokens: int, job: Any, ep: int) -> int:
    return tokens * model.routed_ranks(ep)


DISPATCHERS.register(Dispatcher(
    name="ragged", summary="dropless: row counts exchanged, then one variable all-to-all per tensor",
    runtime="orangetron.parallel.expert.ragged", records=_all_to_all_records(_ragged_rows), chunked=True))
DISPATCHERS.register(Dispatcher(
    name="capacity", summary="at most capacity_factor x the fair share per expert, padded to fixed rows",
    runtime="orangetron.parallel.expert.capacity", records=_all_to_all_records(_capacity_rows),
    rows=_capacity_rows, pads=True))
DISPATCHERS.register(Dispatcher(
    name="allgather", summary="the ep group's tokens gathered, each rank keeps its experts' rows",
    runtime="orangetron.parallel.expert.allgather", records=_allgather_records,
    mask_bytes=lambda model, tokens, job, ep, rows: ep * tokens * model.top_k))
DISPATCHERS.register(Dispatcher(
    name="deepep", summary="planner only: a token crosses to each remote node once, then NVLink (DeepEP)",
    node_aware=True))
