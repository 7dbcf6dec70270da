"""Per-step communication of one rank as `CommRecord`s: the same records the runtime ledger writes.

Every byte count goes through `orangetron.spec.collectives`, the formulas the ledger uses. Counts follow the
runtime's conventions (docs/runtime.md's ledger, docs/data_parallel.md's tables):
- DP: DDP all-reduces gradients over dp_cp (dense) and edp (experts); ZeRO-1/2 reduce-scatter gradients and
  all-gather parameters lazily before the next forward; the distributed optimizer reduce-scatters and
  all-gathers eagerly after the step; ZeRO-3 all-gathers parameters before each forward and each backward
  (per micro-batch) and reduce-scatters gradients. Gradients travel in `reduce_dtype` (default param dtype),
  parameters in the param dtype. Flat buffers are padded to a multiple of the shard count.
- TP per layer and micro-batch: without SP, forward all-reduces after the attention and MLP output
  projections and backward all-reduces the input gradients of the two column-parallel inputs (4 AR); with
  SP, forward all-gathers before and reduce-scatters after each block, backward mirrors them and re-gathers
  the two sequence-sharded inputs it saved (6 AG + 4 RS, as Megatron). Full recompute replays the forward.
  An MoE layer without a shared expert splits only its attention (its experts stay whole on every tp
  rank). Once per step, partial gradients are summed over tp (`tensor_parallel_grad_records`).
- CP per layer and micro-batch: ring passes K,V cp-1 times forward, K,V cp-1 times and dK,dV cp times
  backward; ring self-attention the same with K and V in separate rings; all-gather gathers K,V forward and
  again in backward, and reduce-scatters dK,dV; Ulysses all-to-alls Q, K+V (kv heads replicated up to one
  per rank) and the output forward and their gradients backward.
- EP per MoE layer and micro-batch: the dispatcher's collectives (`expert_parallel_records`), with balanced
  routing: one row per (token, destination rank), each token on min(top_k, ep) ranks (fewer under
  group-limited routing, `ModelSpec.routed_ranks`), rows spread evenly;
  the global balancing loss's all-reduce; with clipping, the experts' squared norm summed over ep. With
  etp = tp the experts' tp collectives on the received rows (`expert_tensor_parallel_records`).
- PP per micro-batch and model chunk: activations forward and their gradients backward, one record for the
  sending side and one for the receiving side; with clipping, the squared norm summed over pp once a step;
  with tied embeddings, the two copies' gradients summed over the first and last stage once a step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache

from orangetron.plan import node_dispatch
from orangetron.plan.memory import data_parallel_segments
from orangetron.plan.network import Placement
from orangetron.plan.packed import priced_batches, ring_steps
from orangetron.plan.params import (
    embedding_at_both_ends,
    shard_groups,
    stage_params,
    sums_first,
    tp_grad_sum_numel,
    zero3_unit_contents,
)
from orangetron.spec import collectives as cf
from orangetron.spec.collectives import CommRecord, send_recv_records
from orangetron.spec.context_modes import kv_bytes, ulysses_kv_heads
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.sharding import bucket_layout, padded_numel
from orangetron.spec.stages import replay_split, stage_layers
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS


@lru_cache(maxsize=16384)  # one object per distinct record: timing prices each object once (equal buckets)
def _gather(op: str, dim: str, full: int, n: int) -> CommRecord:
    fn = {"all_gather": cf.all_gather_bytes, "reduce_scatter": cf.reduce_scatter_bytes,
          "all_reduce": cf.all_reduce_bytes}[op]
    return CommRecord(op, dim, full, *fn(full, n))


@lru_cache(maxsize=16384)
def _a2a(dim: str, payload: int, n: int) -> CommRecord:
    per_peer = payload // n  # balanced: equal rows to every rank
    sent, received = cf.all_to_all_bytes([per_peer] * n, [per_peer] * n, 0)
    return CommRecord("all_to_all", dim, payload, sent, received)


# ---- data parallel ------------------------------------------------------------------------------
def _buckets(numel: int, bucket_numel: int) -> list[int]:
    if bucket_numel <= 0 or numel <= bucket_numel:
        return [numel]
    full, rest = divmod(numel, bucket_numel)
    return [bucket_numel] * full + ([rest] if rest else [])


def data_parallel_records(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> list[CommRecord]:
    """Gradient reduction and parameter gathers of one step (docs/data_parallel.md's one-step table),
    one record per bucket: DDP's fixed slices of `job.grad_bucket_numel` elements, the sharded stages' equal
    buckets (`plan.sharding.bucket_layout`), ZeRO-3's units."""
    params = stage_params(model, deg, stage, job.virtual_stages, job.pipeline_layout)
    m = job.replica_microbatches(deg)
    sharding = job.zero_stage >= 1 or job.distributed_optimizer
    rounds = reduce_rounds(model, deg, job)
    out: list[CommRecord] = []
    for dim, n, numel in shard_groups(params, deg):
        if n <= 1 or numel == 0:
            continue
        if job.zero_stage == 3:  # one bucket per unit: gathered and reduce-scattered unit by unit
            buckets = [size for d, _, size in data_parallel_segments(model, deg, job, stage) if d == dim]
        elif sharding:  # equal buckets, each a multiple of n, each sharded on its own
            count, size = bucket_layout(numel, job.grad_bucket_numel, n)
            buckets = [size] * count
        else:
            buckets = _buckets(numel, job.grad_bucket_numel)
        for bucket in buckets:
            out += _bucket_records(dim, n, padded_numel(bucket, n if sharding else 1), job, m, rounds)
        if sharding and job.clip_grad:
            # The global gradient norm: one all-reduce of this rank's sum of squares (main-grad dtype).
            out.append(_gather("all_reduce", dim, 4 if job.mixed_precision else job.param_bytes, n))
    if job.clip_grad and deg.ep > 1 and params.expert:  # every ep rank holds other experts: sum their squares
        out.append(_gather("all_reduce", "ep", 4 if job.mixed_precision else job.param_bytes, deg.ep))
    return out


def zero3_unit_records(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> list[list[CommRecord]]:
    """Each ZeRO-3 unit's transfers of one pass, in forward order: one all-gather and one reduce-scatter per
    data-parallel buffer it has a share of (`data_parallel_records` repeats them per pass and round)."""
    out = []
    for unit, _ in zero3_unit_contents(model, deg, stage, job.virtual_stages, job.pipeline_layout):
        records = []
        for dim, n, numel in shard_groups(unit, deg):
            if n > 1 and numel:
                padded = padded_numel(numel, n)
                records += [_gather("all_gather", dim, padded * job.param_bytes, n),
                            _gather("reduce_scatter", dim, padded * job.reduce_bytes, n)]
        out.append(records)
    return out


def reduce_rounds(model: ModelSpec, deg: Degrees, job: Job) -> int:
    """Gradient reductions per step: one, or one per micro-batch under ZeRO-3 with
    `zero3_reduce_every_microbatch` (unless gradients are first summed, `params.sums_first`: then all at the
    step)."""
    if job.zero_stage == 3 and job.zero3_reduce_every_microbatch and not sums_first(model, deg, job):
        return job.replica_microbatches(deg)
    return 1


def _bucket_records(dim: str, n: int, numel: int, job: Job, m: int, rounds: int) -> list[CommRecord]:
    grads, weights = numel * job.reduce_bytes, numel * job.param_bytes
    if job.zero_stage == 0 and not job.distributed_optimizer:
        return [_gather("all_reduce", dim, grads, n)]
    if job.zero_stage == 3:  # before every forward and every backward (forward only when kept)
        gathers = [_gather("all_gather", dim, weights, n)] * ((1 if job.zero3_keep_params else 2) * m)
    else:  # lazy (ZeRO-1/2) or eager (distributed optimizer): once per step
        gathers = [_gather("all_gather", dim, weights, n)]
    return gathers + [_gather("reduce_scatter", dim, grads, n)] * rounds


# ---- per-layer model parallel traffic ----------------------------------------------------------
def _act_bytes(model: ModelSpec, deg: Degrees, job: Job) -> int:
    """The [s/cp, b, h] activation of one micro-batch, gathered over tp (TP's payload)."""
    return job.param_bytes * (job.seq_len // deg.cp) * job.micro_batch * model.hidden_size


def tensor_parallel_records(model: ModelSpec, deg: Degrees, job: Job, blocks: int = 2) -> list[CommRecord]:
    """TP collectives of one layer, one micro-batch, forward + backward (+ replayed forward).

    `blocks` is the layer's split blocks: attention and the MLP (2), or attention alone (1, an MoE layer
    whose experts stay whole on every tp rank and that has no shared expert). Per block: without SP an
    all-reduce forward and one backward; with SP an all-gather and a reduce-scatter forward, and backward
    their mirrors plus the re-gather of the saved sequence shard.
    """
    t = deg.tp
    if t == 1:
        return []
    a = _act_bytes(model, deg, job)
    replay = 1 if job.recompute == "full" else 0
    if not job.sequence_parallel:
        return [_gather("all_reduce", "tp", a, t)] * ((2 + replay) * blocks)
    ag, rs = (3 + replay) * blocks, (2 + replay) * blocks
    return [_gather("all_gather", "tp", a, t)] * ag + [_gather("reduce_scatter", "tp", a, t)] * rs


def _split_blocks(model: ModelSpec, index: int) -> int:
    """Blocks of layer `index` that tensor parallelism splits (see `tensor_parallel_records`)."""
    return 1 if model.is_moe_layer(index) and not model.num_shared_experts else 2


def tensor_parallel_grad_records(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> list[CommRecord]:
    """Once per step under TP: the all-reduce that sums partial gradients over tp, and with clipping the
    all-reduce of the squared gradient norm's tp parts.

    Partial gradients: with SP every parameter replicated over tp (norm weights, router, shared-expert gate,
    routed experts) has seen only this rank's tokens; a kv head replicated over tp ranks has seen only their query heads
    (each rank sends a zero-filled slot per kv head so that one all-reduce sums exactly the copies).
    """
    t = deg.tp
    if t == 1:
        return []
    numel = tp_grad_sum_numel(model, deg, job, stage)
    out = [_gather("all_reduce", "tp", numel * job.param_bytes, t)] if numel else []
    if job.clip_grad:
        out.append(_gather("all_reduce", "tp", 4 if job.mixed_precision else job.param_bytes, t))
    return out


def context_parallel_records(model: ModelSpec, deg: Degrees, job: Job, cp_rank: int | None = None) -> list[CommRecord]:
    """CP collectives of one layer, one micro-batch, forward + backward (+ replayed forward): what the job's
    cp mode registers (spec/context_modes.py). Ring attention over packed documents (`job.packed`) sends
    each cp rank its own sizes: those of `cp_rank`, or (None) of the rank that receives the most."""
    if deg.cp == 1:
        return []
    passes = 2 if job.recompute == "full" else 1
    mode = CONTEXT_MODES[job.cp_mode]
    if job.packed and model.causal and mode.packed_ring:
        return _packed_ring_records(model, deg, job, passes, cp_rank, *mode.packed_ring(deg, job))
    return mode.records(model, deg, job, passes)


def _packed_ring_records(model: ModelSpec, deg: Degrees, job: Job, passes: int, cp_rank: int | None, u: int,
                         dim: str) -> list[CommRecord]:
    """A K,V ring over packed documents, each member `u` cp ranks (USP's Ulysses groups; 1 for ring attention)
    on planner group `dim`: its transfers carry the runs of keys a member still to visit sees
    (`plan.packed.ring_steps`), a transfer with nothing either way is not made; the dK,dV accumulators still go
    all the way home, one hop per member. The mode's other records (USP's all-to-alls) are one sequence's."""
    members = deg.cp // u
    others = [r for r in CONTEXT_MODES[job.cp_mode].records(model, deg, job, passes) if r.op != "send_recv"]
    if members == 1:
        return others
    home = kv_bytes(model, deg, job, heads=ulysses_kv_heads(model, deg, u))  # u = 1: this rank's own kv heads
    per_token = home / (u * (job.seq_len // deg.cp))
    steps = ring_steps(priced_batches(job), job.seq_len, deg.cp, u)
    member = max(range(members), key=lambda m: sum(got for _, got in steps[m])) if cp_rank is None else cp_rank // u
    one_pass = []
    for sent, got in steps[member]:
        sent_bytes, got_bytes = round(sent * per_token), round(got * per_token)
        if sent_bytes or got_bytes:
            one_pass.append(CommRecord("send_recv", dim, sent_bytes, sent_bytes, got_bytes))
    return others + one_pass * (passes + 1) + send_recv_records(dim, home, members)


def expert_parallel_records(model: ModelSpec, deg: Degrees, job: Job,
                            ep_where: Placement | None = None) -> list[CommRecord]:
    """EP collectives of one MoE layer, one micro-batch, as `parallel.expert.Dispatcher` issues them.

    ragged and capacity: the counts (1 + E/ep int64 per peer: rows, then assignments per expert of that peer),
    then the rows, their local expert ids (int64) and routing weights (float32, float64 for float64) forward;
    backward returns the rows' and the weights' gradients; combine sends the outputs back and its backward the
    gradients out again. A row is one token for one destination rank: with balanced routing each token's top_k
    experts lie on `model.routed_ranks(ep)` ranks (min(top_k, ep) without group-limited routing) and every rank
    receives as many rows as it sends.
    capacity pads every destination to min(E/ep * capacity, tokens) rows, capacity = ceil(tokens * top_k / E
    * capacity_factor). ragged with `ep_overlap_chunks` c: one count exchange of c * (1 + E/ep) int64 per peer,
    then the row records once per token chunk.
    deepep (planner only): one record per dispatch or combine with the bytes `node_dispatch.bytes_sent` counts
    for the EP group's placement `ep_where`.
    allgather: the counts (1 + ep + E int64 per rank), then tokens, ids and weights gathered forward and
    reduce-scattered backward (tokens and weights); combine reduce-scatters the outputs and its backward
    gathers again.
    """
    e = deg.ep
    if e == 1:
        return []
    tokens = routed_tokens(deg, job)
    dispatcher = DISPATCHERS[job.dispatcher]
    if dispatcher.node_aware:  # what crosses nodes depends on where the group lies
        if ep_where is None:
            raise ValueError(f"dispatcher {job.dispatcher!r}: its traffic needs the EP group's placement on nodes")
        sent = node_dispatch.bytes_sent(model, ep_where, job, tokens)
        return [CommRecord("all_to_all", "ep", b, b, b) for b in sent]
    return dispatcher.records(model, deg, job, tokens)


def routed_tokens(deg: Degrees, job: Job) -> int:
    """Tokens one rank routes per micro-batch: its sequence shard, split over tp under SP."""
    tokens = (job.seq_len // deg.cp) * job.micro_batch
    return tokens // deg.tp if job.sequence_parallel else tokens


def _received_rows(model: ModelSpec, deg: Degrees, job: Job) -> int:
    """Rows (one per token and destination rank) an EP rank receives per micro-batch, on balance; without EP
    every token is one row."""
    e, tokens = deg.ep, routed_tokens(deg, job)
    if e == 1:
        return tokens
    return DISPATCHERS[job.dispatcher].rows(model, tokens, job, e)


def expert_tensor_parallel_records(model: ModelSpec, deg: Degrees, job: Job) -> list[CommRecord]:
    """TP collectives of one MoE layer, one micro-batch, when its routed experts are split over tp as well
    (etp = tp; planner only, the runtime runs etp = 1), as Megatron-Core's expert tensor parallelism does.

    With SP every tp rank dispatches its own sequence shard (the EP records do not change), then all-gathers
    over tp the rows it received with their expert ids and weights, so that each tp rank runs its slice of
    every local expert (column-parallel up, row-parallel down) on all of them, and reduce-scatters the partial
    outputs before the combine; backward reduce-scatters the rows' and weights' gradients and all-gathers the
    output gradients. Without SP the rows are already the same on every tp rank: the partial outputs are
    all-reduced forward and the input gradients backward, as a dense MLP block. Full recompute replays the
    forward.
    """
    t = deg.etp
    if t == 1:
        return []
    rows = _received_rows(model, deg, job)
    row, k = job.param_bytes * model.hidden_size, model.top_k
    replays = 1 if job.recompute == "full" else 0
    if not job.sequence_parallel:
        return [_gather("all_reduce", "etp", rows * row, t)] * (2 + replays)
    weights = (8 if job.param_bytes == 8 else 4) * k
    forward = [_gather("all_gather", "etp", t * rows * b, t) for b in (row, 8 * k, weights)]
    forward += [_gather("reduce_scatter", "etp", t * rows * row, t)]
    backward = [_gather("reduce_scatter", "etp", t * rows * b, t) for b in (row, weights)]
    backward += [_gather("all_gather", "etp", t * rows * row, t)]
    return forward * (1 + replays) + backward


def balancing_loss_records(model: ModelSpec, deg: Degrees, job: Job) -> list[CommRecord]:
    """Per MoE layer and micro-batch: the global balancing loss sums the expert counts, normalized scores
    and token count (2E + 1 values, float32 or float64) over dp x cp, and over tp under SP; the router
    z-loss sums its squared logsumexps and token count (2 values) in a second all-reduce."""
    values = (2 * model.num_experts + 1 if model.aux_loss_coef else 0, 2 if model.router_z_loss_coef else 0)
    acc = 8 if job.param_bytes == 8 else 4
    groups = [("dp_cp", deg.dp_cp)] + ([("tp", deg.tp)] if job.sequence_parallel else [])
    passes = 2 if job.recompute == "full" else 1
    return [_gather("all_reduce", dim, v * acc, n) for v in values if v for dim, n in groups if n > 1] * passes


def pipeline_records(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> list[CommRecord]:
    """PP transfers of one micro-batch on `stage`: activations forward, gradients backward, per chunk."""
    p = deg.pp
    if p == 1:
        return []
    a = _act_bytes(model, deg, job) // (deg.tp if job.sequence_parallel else 1)
    chunks = p * job.virtual_stages
    send = CommRecord("send_recv", "pp", a, a, 0)
    recv = CommRecord("send_recv", "pp", 0, 0, a)
    out: list[CommRecord] = []
    for v in range(job.virtual_stages):
        c = stage + v * p
        if c > 0:  # receive the input, send its gradient back
            out += [recv, send]
        if c < chunks - 1:  # send the output, receive its gradient
            out += [send, recv]
    return out


def pipeline_grad_records(deg: Degrees, job: Job) -> list[CommRecord]:
    """Once per step under PP with clipping: the squared gradient norm summed over the stages, each of
    which holds other parameters (main-grad dtype)."""
    if deg.pp == 1 or not job.clip_grad:
        return []
    return [_gather("all_reduce", "pp", 4 if job.mixed_precision else job.param_bytes, deg.pp)]


def step_records(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0,
                 ep_where: Placement | None = None, cp_rank: int | None = None) -> list[CommRecord]:
    """Every collective one rank of pipeline `stage` issues in one training step, in the ledger's shape
    (`ep_where`: the EP group's placement, which the "deepep" dispatcher's traffic depends on; `cp_rank`: the
    rank's cp index, which a packed ring's sizes depend on, else the busiest)."""
    layers = stage_layers(model.num_layers, deg.pp, job.virtual_stages, stage, job.pipeline_layout)
    moe = sum(model.is_moe_layer(i) for i in layers)
    m = job.replica_microbatches(deg)
    per_mb: list[CommRecord] = []
    cp_step: list[CommRecord] = []  # every micro-batch's cp records
    for layer_job, mine in _replay_groups(model, deg, job, stage, layers):
        n_moe = sum(model.is_moe_layer(i) for i in mine)
        for batch_job, times in _micro_batch_jobs(layer_job, m):
            cp_step += context_parallel_records(model, deg, batch_job, cp_rank) * len(mine) * times
        per_mb += (expert_parallel_records(model, deg, layer_job, ep_where)
                   + expert_tensor_parallel_records(model, deg, layer_job)
                   + balancing_loss_records(model, deg, layer_job)) * n_moe
        for i in mine:
            per_mb += tensor_parallel_records(model, deg, layer_job, _split_blocks(model, i))
    per_mb += pipeline_records(model, deg, job, stage) + _vocab_records(model, deg, job, stage)
    if stage == deg.pp - 1:
        per_mb += _mtp_records(model, deg, job, ep_where) * model.mtp_layers
        moe += model.mtp_layers * model.is_moe_layer(model.mtp_layer_index)
    per_step = tensor_parallel_grad_records(model, deg, job, stage) + data_parallel_records(model, deg, job, stage)
    per_step += pipeline_grad_records(deg, job) + tied_embedding_records(model, deg, job, stage)
    per_step += router_bias_records(model, deg, job, moe)
    return cp_step + per_mb * m + per_step


def _micro_batch_jobs(job: Job, m: int) -> list[tuple[Job, int]]:
    """(a job, how many of the step's `m` micro-batches run as it): `job` for all of them, or, where the job names
    the documents of each micro-batch (`doc_batches`), one job per micro-batch with its own documents:
    a packed ring's transfers are each micro-batch's own."""
    if not job.doc_batches:
        return [(job, m)]
    if len(job.doc_batches) != m:
        raise ValueError(f"doc_batches names {len(job.doc_batches)} micro-batches; the step runs {m}")
    return [(replace(job, doc_batches=(batch,)), 1) for batch in job.doc_batches]


def tied_embedding_records(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> list[CommRecord]:
    """Once per step on the first and last stage where the last holds a copy of the embedding (a tied head, or
    MTP modules: `params.embedding_at_both_ends`): the all-reduce that sums the two copies' gradients (this rank's
    vocab shard) over those two stages. The runtime sums each
    stage's `.grad` (parameter dtype) before the data-parallel reduction; a framework that sums after it
    (`Job.tp_sum_with_reduction`, as Megatron-Core's `finalize_model_grads`) sends its main gradients."""
    if not embedding_at_both_ends(model, deg.pp) or stage not in (0, deg.pp - 1):
        return []
    main = 4 if job.mixed_precision else job.param_bytes
    copy = -(-model.vocab_size * model.hidden_size // deg.tp)  # this rank's vocab shard (`head_weights`)
    nbytes = copy * (main if job.tp_sum_with_reduction else job.param_bytes)
    return [_gather("all_reduce", "pp", nbytes, 2)]


def _mtp_records(model: ModelSpec, deg: Degrees, job: Job, ep_where: Placement | None) -> list[CommRecord]:
    """One multi-token-prediction module per micro-batch: its layer's traffic, as a decoder layer of its kind
    that is not replayed under partial recompute, and its own pass through the vocab-parallel head and loss.
    The 2h -> h projection's TP traffic is not counted."""
    if not model.mtp_layers:
        return []
    layer_job, i = job.layer_job(False), model.mtp_layer_index
    out = context_parallel_records(model, deg, layer_job) + tensor_parallel_records(model, deg, layer_job,
                                                                                    _split_blocks(model, i))
    if model.is_moe_layer(i):
        out += expert_parallel_records(model, deg, layer_job, ep_where) + \
            expert_tensor_parallel_records(model, deg, layer_job) + balancing_loss_records(model, deg, layer_job)
    return out + _head_records(model, deg, job)


def _replay_groups(model: ModelSpec, deg: Degrees, job: Job, stage: int,
                   layers: tuple[int, ...]) -> list[tuple[Job, tuple[int, ...]]]:
    """(the job they run under, layers) of `stage`: under partial recompute the replayed layers, which repeat
    their forward's traffic, apart from the others; otherwise all of them under `job`."""
    if not job.partial_recompute:
        return [(job, layers)]
    split = replay_split(model.num_layers, deg.pp, job.virtual_stages, stage, job.recompute_layers, layers,
                         job.pipeline_layout)
    return [(job.layer_job(flag), mine) for flag, mine in split]


def router_bias_records(model: ModelSpec, deg: Degrees, job: Job, moe_layers: int) -> list[CommRecord]:
    """Per step: the bias update sums the stage's expert loads (int64, E per MoE layer) over dp x cp, and
    over tp under SP."""
    if not model.router_bias or not moe_layers:
        return []
    groups = [("dp_cp", deg.dp_cp)] + ([("tp", deg.tp)] if job.sequence_parallel else [])
    return [_gather("all_reduce", dim, 8 * model.num_experts * moe_layers, n) for dim, n in groups if n > 1]


def _vocab_records(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> list[CommRecord]:
    """Vocab-parallel embedding (stage 0) and output layer + cross entropy (last stage) under TP."""
    if deg.tp == 1:
        return []
    a, t = _act_bytes(model, deg, job), deg.tp
    out: list[CommRecord] = []
    if stage == 0:  # the vocab shards' partial embeddings are summed (SP: and scattered over the sequence)
        if job.sequence_parallel:  # backward all-gathers the sequence-sharded gradient for the embedding lookup
            out += [_gather("reduce_scatter", "tp", a, t), _gather("all_gather", "tp", a, t)]
        else:  # backward of the all-reduce is the identity
            out.append(_gather("all_reduce", "tp", a, t))
    if stage == deg.pp - 1 and model.vocab_size:
        out += _head_records(model, deg, job)
    return out


def _head_records(model: ModelSpec, deg: Degrees, job: Job) -> list[CommRecord]:
    """The vocab-parallel output layer and cross entropy of one micro-batch under TP."""
    if deg.tp == 1:
        return []
    a, t = _act_bytes(model, deg, job), deg.tp
    if job.sequence_parallel:  # gather the sequence for the output projection; backward scatters its gradient,
        out = [_gather("all_gather", "tp", a, t)] * 2 + [_gather("reduce_scatter", "tp", a, t)]  # re-gathers input
    else:
        out = [_gather("all_reduce", "tp", a, t)]
    # Every tp rank holds logits for all s*b tokens (its vocab shard), gathered sequence or not; the
    # vocab-parallel cross entropy reduces each token's maximum, then its sum of exponentials and
    # target logit together, in float32 (float64 for float64).
    rows = (8 if job.param_bytes == 8 else 4) * (job.seq_len // deg.cp) * job.micro_batch
    return out + [_gather("all_reduce", "tp", rows, t), _gather("all_reduce", "tp", 2 * rows, t)]


def summarize(records: Iterable[CommRecord]) -> dict[str, dict[str, int]]:
    """Totals per `op/dim`: calls, payload, sent and received bytes."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "payload": 0, "sent": 0, "received": 0})
    for r in records:
        row = out[r.key]
        row["calls"] += 1
        row["payload"] += r.payload_bytes
        row["sent"] += r.bytes_sent
        row["received"] += r.bytes_received
    return dict(sorted(out.items()))

