"""Ring attention: K,V blocks travel around the cp ring while the block at hand computes.

Forward: cp steps; at step i this rank attends to the K,V of cp rank r-i, received while step i-1
computed (cp-1 transfers). Backward: the K,V go around again (cp-1 transfers) with an accumulator of
their gradients that ends back home (cp transfers); dq stays local. Each accumulator is sent after its
block and waited for only after the next block has computed, so every transfer but its last trip home
travels behind a block (`tests/test_context_attention.py` checks the order).

Under head-tail causal sharding (rank r holds chunks r and 2cp-1-r) every step after the first does the
same work on every rank, as zigzag ring attention does: of the K,V of an earlier rank (j < r) only its
head chunk is early enough, and both local chunks attend to it; the K,V of a later rank (j > r) is seen
only by the local tail chunk, which attends to all of it. `blocks.attend` finds these calls from the
positions (`calls.plan`): one unmasked kernel call per step after the first, and the first step's
diagonal as two causal calls and one unmasked one.

Over packed documents (sharded in balance, `calls.document_runs`) a block travels only as far as it is seen,
run by run (`Route`): a run goes on from a member only while a member it has still to visit sees some of
it, and members that see none of the block at hand skip it. Under the balanced sharding a block's tail runs
are seen by exactly the members it visits first, so each member receives exactly the keys it sees, in
forward and in backward alike (sender and receiver decide from the same documents). The dK,dV accumulators
still go all the way home, whole.
"""

from __future__ import annotations

import bisect

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.model.attention import Runs
from orangetron.model.documents import Documents
from orangetron.parallel.context import calls
from orangetron.parallel.context.blocks import attend, attend_backward, merge, pack


def ring_runs(layout: tuple, member: int) -> Runs:
    """Global positions, as runs, of the tokens ring member `member` holds.

    layout ("shards", seq_len, cp, cuts): member r holds cp rank r's shard (`calls.shard_runs`; cuts None:
    head-tail). ("usp", seq_len, cp, u, cuts): ring member r holds the shards of cp ranks r*u ... r*u+u-1,
    gathered by Ulysses, in that order.
    """
    if layout[0] == "shards":
        _, seq_len, cp, cuts = layout
        return calls.shard_runs(seq_len, cp, member, cuts)
    _, seq_len, cp, u, cuts = layout
    return tuple(run for j in range(u) for run in calls.shard_runs(seq_len, cp, member * u + j, cuts))


class Route:
    """Which runs of each member's block each ring step carries.

    `sees[p][j][i]`: member p's queries see some key of run i of member j. Block j is at member j+s (mod cp)
    at step s and carries there the runs a member at step s or later sees (all of them at step 0). Without
    packed documents every member sees every run, and blocks travel whole.
    """

    def __init__(self, runs: list[Runs], causal: bool, documents: Documents | None) -> None:
        self.runs = runs
        self.sees = _sees(runs, causal, documents)
        cp = len(runs)
        # carried[j][s]: block j's runs at step s (all of them at step 0), worked out once per forward.
        self._carried = [[tuple(range(len(runs[j])))] + [
            tuple(i for i in range(len(runs[j])) if any(self.sees[(j + visit) % cp][j][i] for visit in range(s, cp)))
            for s in range(1, cp)] for j in range(cp)]

    def carried(self, block: int, step: int) -> tuple[int, ...]:
        """Indices of block `block`'s runs it carries at `step`."""
        return self._carried[block][step]

    def carried_runs(self, block: int, step: int) -> Runs:
        return tuple(self.runs[block][i] for i in self.carried(block, step))

    def seen(self, member: int, block: int, step: int) -> bool:
        """Whether `member` sees any of the runs `block` carries to it at `step`."""
        return any(self.sees[member][block][i] for i in self.carried(block, step))

    def rows(self, block: int, step: int, within: int) -> tuple[tuple[int, int], ...] | None:
        """Tensor rows [start, stop), in the block as carried at step `within` (0: home), of the runs it carries
        at `step`; None when they are all of them."""
        inner, outer = self.carried(block, step), self.carried(block, within)
        if inner == outer:
            return None
        offsets, at = {}, 0
        for i in outer:
            start, stop = self.runs[block][i]
            offsets[i] = (at, at + stop - start)
            at += stop - start
        return tuple(offsets[i] for i in inner)


def _sees(runs: list[Runs], causal: bool, documents: Documents | None) -> list[list[list[bool]]]:
    """sees[p][j][i] (`Route`): member p holds, in some row, a query at or after the start of run i of member j
    in the same document (then it sees that key, and the kernel calls `calls.plan` makes include it). A member's
    own block never travels to it: taken as seen."""
    if documents is None or not causal:
        return [[[True] * len(block) for block in runs] for _ in runs]
    ends = [_document_ends(spans) for _, spans in documents.row_groups()]
    held = [_Held(calls.sort_runs(member)[0]) for member in runs]
    return [[[p == j or any(held[p].any_in(lo, end(lo)) for end in ends) for lo, _ in block]
             for j, block in enumerate(runs)] for p in range(len(runs))]


def _document_ends(spans: tuple[tuple[int, int], ...]):
    """position -> the end of the document of one row that holds it."""
    starts, stops = [a for a, _ in spans], [b for _, b in spans]
    return lambda position: stops[bisect.bisect_right(starts, position) - 1]


class _Held:
    """A member's positions, as increasing runs, asked whether it holds one in a range."""

    def __init__(self, ordered: Runs) -> None:
        self.starts, self.stops = [a for a, _ in ordered], [b for _, b in ordered]

    def any_in(self, lo: int, hi: int) -> bool:
        at = bisect.bisect_right(self.stops, lo)  # the first run that ends after lo
        return at < len(self.stops) and self.starts[at] < hi


def _take_rows(x: torch.Tensor, rows: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
    """The rows [start, stop) of x [B, S, ...] along dim 1, in order (x itself for None)."""
    if rows is None:
        return x
    return torch.cat([x[:, start:stop] for start, stop in rows], dim=1)


def _start(ring: comm.RingExchange, route: Route, kv: torch.Tensor | None, home: torch.Tensor, rank: int,
           step: int) -> None:
    """Post the transfer after `step`: the block at hand (`kv`, None when nothing came) trimmed to what it
    carries next, and the previous member's as it will arrive here; `home` gives shapes."""
    cp = len(route.runs)
    mine, theirs = (rank - step) % cp, (rank - 1 - step) % cp
    sending = bool(route.carried(mine, step + 1))
    send = _take_rows(kv, route.rows(mine, step + 1, step)) if sending else home
    incoming = calls.total(route.carried_runs(theirs, step + 1))
    ring.start(send, sending, incoming > 0, (home.shape[0], incoming, *home.shape[2:]))


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (see the module docstring); saves q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, group: MeshGroup, causal: bool, scale: float, overlap: bool, layout: tuple,
                impl: str, documents: Documents | None):
        length, cp, r = q.shape[1], group.size, group.rank
        def build() -> Route:
            return Route([ring_runs(layout, j) for j in range(cp)], causal, documents)

        route = build() if documents is None else documents.memo(("ring route", layout, causal), build)
        out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], length), float("-inf"), dtype=out.dtype, device=q.device)
        ring, home = comm.RingExchange(group), pack(k, v)
        kv = home
        for step in range(cp):
            last = step == cp - 1
            source = (r - step) % cp
            if not last:
                _start(ring, route, kv, home, r, step)  # travels while this one computes
                arrived = None if overlap else ring.wait()  # serial, for comparison: transfer, then compute
            if kv is not None and route.seen(r, source, step):
                kb, vb = kv.split(k.shape[-1], dim=-1)
                block_out, block_lse = attend(q, kb, vb, route.runs[r], route.carried_runs(source, step),
                                              causal, scale, impl, documents)
                merge(out, lse, block_out, block_lse)
            if not last:
                kv = ring.wait() if overlap else arrived
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.impl = group, causal, scale, impl
        ctx.documents, ctx.route = None if documents is None else documents.kept_for(impl), route
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, route = ctx.group, ctx.causal, ctx.scale, ctx.route
        cp, r, d = group.size, group.rank, k.shape[-1]
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv_ring, grad_ring = comm.RingExchange(group), comm.RingExchange(group)
        home = pack(k, v)
        kv = home
        for step in range(cp):
            if step < cp - 1:
                _start(kv_ring, route, kv, home, r, step)
            source = (r - step) % cp
            block = None
            if kv is not None and route.seen(r, source, step):
                kb, vb = kv.split(d, dim=-1)
                dq_b, dk_b, dv_b = attend_backward(q, kb, vb, out, lse, grad_out, route.runs[r],
                                                   route.carried_runs(source, step), causal, scale, ctx.impl,
                                                   ctx.documents)
                dq += dq_b
                block = torch.cat((dk_b, dv_b), dim=-1)
            # The accumulator of these K,V gradients left the previous rank after its last step: it travelled
            # while this block computed, and is waited for only now.
            dkv = torch.zeros_like(home) if step == 0 else grad_ring.wait()
            if block is not None:
                _add_rows(dkv, block.to(dkv.dtype), route.rows(source, step, 0))
            grad_ring.start(dkv)  # on to the next rank, with its K,V; it ends at their owner
            if step < cp - 1:
                kv = kv_ring.wait()
        dkv = grad_ring.wait()
        dk, dv = dkv.split(d, dim=-1)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def _add_rows(home: torch.Tensor, part: torch.Tensor, rows: tuple[tuple[int, int], ...] | None) -> None:
    """home[:, rows] += part, where part holds those rows in order (all of home for None)."""
    if rows is None:
        home += part
        return
    at = 0
    for start, stop in rows:
        home[:, start:stop] += part[:, at:at + stop - start]
        at += stop - start


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float, impl: str = "fused", overlap: bool = True, layout: tuple | None = None,
              documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's shard; (out [B, L, Hq, D], lse [B, Hq, L]).

    `impl` is the block kernel (`blocks.attend`). `overlap=False` waits for each forward transfer before
    computing (a serial ring, for comparison). `layout` says whose tokens each ring member holds
    (`ring_runs`; default: each cp rank's own shard, of the sharding `documents` take). `documents`: those of
    packed rows over the global sequence.
    """
    layout = ("shards", q.shape[1] * group.size, group.size, calls.cuts_of(documents)) if layout is None else layout
    return _RingAttention.apply(q, k, v, group, causal, scale, overlap, layout, impl, documents)
