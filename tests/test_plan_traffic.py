"""Per-step CommRecords: docs/data_parallel.md's one-step table and docs/context_parallel.md's per-layer volumes.

These are the records the runtime ledger will be compared with (op, mesh dim, payload, sent, received),
computed with `orangetron.spec.collectives`, the ledger's own formulas.
"""

import pytest

from orangetron.plan.memory import stage_memory, stage_params
from orangetron.plan.traffic import (
    context_parallel_records,
    data_parallel_records,
    expert_parallel_records,
    expert_tensor_parallel_records,
    pipeline_records,
    step_records,
    summarize,
    tensor_parallel_records,
)
from orangetron.spec import collectives as cf
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.sharding import bucket_layout

DENSE = ModelSpec(name="dense", hidden_size=256, num_layers=4, num_heads=8, vocab_size=512, ffn_hidden_size=512)
MOE = ModelSpec(name="moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=512,
                ffn_hidden_size=512, num_experts=8, top_k=2, moe_ffn_hidden_size=128, moe_layer_freq=2)


UNITS = DENSE.num_layers + 2


def keys(records):
    return {k: v["calls"] for k, v in summarize(records).items()}


@pytest.mark.parametrize(("zero", "distopt", "expected"), [
    (0, False, {"all_reduce/dp_cp": 1}),
    (1, False, {"reduce_scatter/dp_cp": 1, "all_gather/dp_cp": 1}),
    (2, False, {"reduce_scatter/dp_cp": 1, "all_gather/dp_cp": 1}),
    (0, True, {"reduce_scatter/dp_cp": 1, "all_gather/dp_cp": 1}),
    # ZeRO-3: per unit (embedding, every layer, head), before fwd and bwd of each of 3 micro-batches
    (3, False, {"reduce_scatter/dp_cp": UNITS, "all_gather/dp_cp": UNITS * 2 * 3}),
])
def test_design_communication_table(zero, distopt, expected):
    deg = Degrees(dp=2, cp=2)
    job = Job(seq_len=64, global_batch=6, zero_stage=zero, distributed_optimizer=distopt)
    records = data_parallel_records(DENSE, deg, job)
    assert keys(records) == expected
    n = stage_params(DENSE, deg, 0).dense
    padded = -(-n // 4) * 4
    if zero == 3:  # every unit padded on its own; together they move the whole model
        assert sum(r.payload_bytes for r in records if r.op == "reduce_scatter") >= 2 * padded
        return
    for r in records:
        # Every entry moves 2N bytes of bf16 (AR = RS + AG), through the ledger's formulas.
        assert r.payload_bytes == 2 * padded
        fn = {"all_reduce": cf.all_reduce_bytes, "all_gather": cf.all_gather_bytes,
              "reduce_scatter": cf.reduce_scatter_bytes}[r.op]
        assert (r.bytes_sent, r.bytes_received) == fn(2 * padded, 4)


def test_fp32_gradient_reduction_option():
    job = Job(seq_len=64, reduce_dtype="float32")
    (record,) = data_parallel_records(DENSE, Degrees(dp=4), job)
    n = stage_params(DENSE, Degrees(dp=4), 0).dense
    assert record.payload_bytes == 4 * (-(-n // 4) * 4)


@pytest.mark.parametrize(("numel", "bucket", "shards", "layout"), [
    (1000, 300, 4, (4, 252)),  # 300 -> 4 buckets; 1000 / 4 = 250, up to 252 (a multiple of 4)
    (7434, 500, 2, (15, 496)),  # the float64 test model of test_data_parallel.py
    (7434, 500, 4, (15, 496)),
    (10, 1, 4, (3, 4)),  # a bucket smaller than the shard count grows to one element per rank
    (100, 0, 3, (1, 102)),  # no buckets: the whole buffer, padded
    (100, 1000, 3, (1, 102)),
])
def test_bucket_layout_by_hand(numel, bucket, shards, layout):
    count, size = bucket_layout(numel, bucket, shards)
    assert (count, size) == layout
    assert (count - 1) * size < numel <= count * size  # padding stays inside the last bucket


def test_sharded_stages_reduce_scatter_and_gather_each_equal_bucket():
    deg = Degrees(dp=3)
    n = stage_params(DENSE, deg, 0).dense  # 2,885,888 bf16 parameters: 29 buckets
    job = Job(seq_len=64, zero_stage=2, grad_bucket_numel=100_000)
    records = data_parallel_records(DENSE, deg, job)
    count = -(-n // 100_002)  # 100,000 rounded up to a multiple of 3
    size = -(-n // (3 * count)) * 3
    assert keys(records) == {"reduce_scatter/dp_cp": count, "all_gather/dp_cp": count}
    assert {r.payload_bytes for r in records} == {2 * size}
    mem = stage_memory(DENSE, deg, job, 0)
    assert mem["grads"] == 4 * count * size // 3  # fp32 main gradients: this rank's slice of every bucket
    assert mem["grad_buckets"] == 2 * (size + size // 3)  # one bf16 wire buffer and its slice
    zero1 = stage_memory(DENSE, deg, Job(seq_len=64, zero_stage=1, grad_bucket_numel=100_000), 0)
    assert zero1["grads"] == 4 * count * size  # the full buffer, bucket padding included
    assert zero1["grad_buckets"] == 2 * (size + size // 3)  # bf16 wire copy of the fp32 bucket, and its slice
    f32 = Job(seq_len=64, zero_stage=1, grad_bucket_numel=100_000, param_dtype="float32")
    assert stage_memory(DENSE, deg, f32, 0)["grad_buckets"] == 4 * size // 3  # reduced where it lies


def test_experts_reduce_over_edp_and_dense_over_dp_cp():
    deg = Degrees(dp=4, cp=2, ep=2)  # edp = 4
    records = data_parallel_records(MOE, deg, Job(seq_len=64, distributed_optimizer=True))
    assert keys(records) == {"all_gather/dp_cp": 1, "reduce_scatter/dp_cp": 1, "all_gather/edp": 1,
                             "reduce_scatter/edp": 1}
    expert = next(r for r in records if r.dim == "edp")
    assert expert.payload_bytes == 2 * stage_params(MOE, deg, 0).expert


def test_tp_volume_per_layer_matches_seed():
    """Seed: per layer with batch B, TP moves 8(N-1)BLH/N (elements, forward + backward)."""
    t, s, b, h = 4, 64, 2, DENSE.hidden_size
    job = Job(seq_len=s, micro_batch=b)
    sent = sum(r.bytes_sent for r in tensor_parallel_records(DENSE, Degrees(tp=t), job))
    assert sent == 2 * 8 * (t - 1) * b * s * h // t
    sp = Job(seq_len=s, micro_batch=b, sequence_parallel=True)
    sp_records = tensor_parallel_records(DENSE, Degrees(tp=t), sp)
    # Same volume as TP, plus backward re-gathering the two sequence-sharded inputs it saved.
    assert sum(r.bytes_sent for r in sp_records) == 2 * 10 * (t - 1) * b * s * h // t
    assert keys(sp_records) == {"all_gather/tp": 6, "reduce_scatter/tp": 4}


def test_cp_ring_and_rsa_volume():
    """Ring: K,V forward cp-1 times, K,V and dK,dV backward (cp-1 and cp times); the published ring
    self-attention volume 6(N-1)BLH/N is the same minus the final dK,dV hop home."""
    c, s, b, h = 4, 64, 1, DENSE.hidden_size
    job = Job(seq_len=s, micro_batch=b)
    records = context_parallel_records(DENSE, Degrees(cp=c), job)
    chunk = 2 * (2 * (s // c) * b * h)  # K and V of this rank, bf16
    assert all(r.bytes_sent == r.bytes_received == chunk for r in records)
    assert len(records) == 3 * c - 2
    elements = sum(r.bytes_sent for r in records) // 2
    assert elements - 2 * b * (s // c) * h == 6 * (c - 1) * b * s * h // c


def test_cp_allgather_and_ulysses():
    c, s, h = 4, 64, DENSE.hidden_size
    ag = context_parallel_records(DENSE, Degrees(cp=c), Job(seq_len=s, cp_mode="allgather"))
    assert keys(ag) == {"all_gather/cp": 2, "reduce_scatter/cp": 1}  # gathered again in backward, not kept
    assert ag[0].payload_bytes == 2 * (2 * s * h)  # gathered K and V of the whole sequence
    uly = context_parallel_records(DENSE, Degrees(cp=c), Job(seq_len=s, cp_mode="ulysses"))
    # Seed: Ulysses moves 4Nd/P per layer forward (Q, K, V, output); backward mirrors it.
    assert sum(r.bytes_sent for r in uly) == 2 * 4 * (c - 1) * (s // c) * h * 2 // c


def test_cp_rsa_sends_keys_and_values_apart_and_ulysses_replicates_few_kv_heads():
    c, s, h = 4, 64, DENSE.hidden_size  # DENSE: 8 heads of 32, multi-head
    rsa = context_parallel_records(DENSE, Degrees(cp=c), Job(seq_len=s, cp_mode="rsa"))
    k_bytes = 2 * (s // c) * h  # bf16 keys of this rank: 16 tokens x 256
    # forward K ring 3 hops and V ring 3 hops; backward V ring 3 + dV home 4, K ring 3 + dK home 4
    assert [r.payload_bytes for r in rsa] == [k_bytes] * 20
    # MOE has 8 heads of 32 and 4 kv heads; over cp=8 each rank sends one kv head per destination (8, not
    # its 4) for its 32 tokens: 2 B x 32 x 8 x (32 + 32). Q and the output are 2 x 32 x 8 x 32 each.
    uly = context_parallel_records(MOE, Degrees(cp=8), Job(seq_len=256, cp_mode="ulysses"))
    assert sorted(r.payload_bytes for r in uly) == [16384] * 4 + [32768] * 2


def test_ep_dispatch_and_combine():
    e, s, k, h = 4, 64, MOE.top_k, MOE.hidden_size
    # ragged: counts, rows, ids, weights, combine forward; rows' and weights' gradients, combine's backward.
    records = expert_parallel_records(MOE, Degrees(dp=4, ep=e), Job(seq_len=s))
    assert keys(records) == {"all_to_all/ep": 8}
    rows = s * min(k, e)  # balanced: each token on min(top_k, ep) ranks, one row per (token, rank)
    payloads = sorted(r.payload_bytes for r in records)
    # The counts: per peer, its rows and this rank's assignments to each of its E/ep experts (int64).
    counts = 8 * e * (1 + MOE.num_experts // e)
    assert payloads == sorted([counts] + [rows * 2 * h] * 4 + [rows * 8 * k] + [rows * 4 * k] * 2)
    assert all(r.bytes_sent == r.payload_bytes * (e - 1) // e == r.bytes_received for r in records)
    # capacity: every destination padded to min(E/ep * ceil(s * k / E * factor), s) rows
    cap = expert_parallel_records(MOE, Degrees(dp=4, ep=e), Job(seq_len=s, dispatcher="capacity",
                                                                 capacity_factor=1.5))
    slots = -(-s * k * 3 // (2 * MOE.num_experts))
    assert max(r.payload_bytes for r in cap) == min(MOE.num_experts // e * slots, s) * e * 2 * h
    # allgather: counts, tokens, ids, weights gathered; combine reduce-scatters; backward mirrors.
    ag = expert_parallel_records(MOE, Degrees(dp=4, ep=e), Job(seq_len=s, dispatcher="allgather"))
    assert keys(ag) == {"all_gather/ep": 5, "reduce_scatter/ep": 3}
    assert sorted(r.payload_bytes for r in ag if r.op == "reduce_scatter") == [e * s * 4 * k] + [e * s * 2 * h] * 2
    # Its counts: per rank, its tokens, its rows for each of the e ranks and its assignments per expert.
    assert ag[0].op == "all_gather" and ag[0].payload_bytes == e * 8 * (1 + e + MOE.num_experts)


def test_expert_tensor_parallel_gathers_received_rows_by_hand():
    """etp = tp = 2, ep = 2, SP, seq 96: each rank routes 48 tokens; each token lies on min(2, 2) = 2 ep ranks,
    so a rank receives 48 * 2 = 96 rows of 256 bf16 (512 B), with 2 int64 ids (16 B) and 2 fp32 weights (8 B).
    Over tp = 2 the gathered payload is twice that; half of it leaves the rank."""
    deg = Degrees(tp=2, dp=2, ep=2, etp=2)
    records = expert_tensor_parallel_records(MOE, deg, Job(seq_len=96, sequence_parallel=True))
    assert keys(records) == {"all_gather/etp": 4, "reduce_scatter/etp": 3}
    gathers = sorted(r.payload_bytes for r in records if r.op == "all_gather")
    assert gathers == [2 * 96 * 8, 2 * 96 * 16, 2 * 96 * 512, 2 * 96 * 512]  # weights, ids, rows, output grads
    scatters = sorted(r.payload_bytes for r in records if r.op == "reduce_scatter")
    assert scatters == [2 * 96 * 8, 2 * 96 * 512, 2 * 96 * 512]  # weight grads, outputs, row grads
    assert all(r.bytes_sent == r.payload_bytes // 2 for r in records)
    # The EP records are those of etp = 1: every tp rank dispatches its own sequence shard.
    assert expert_parallel_records(MOE, deg, Job(seq_len=96, sequence_parallel=True)) == expert_parallel_records(
        MOE, Degrees(tp=2, dp=2, ep=2), Job(seq_len=96, sequence_parallel=True))
    # Without SP the rows (96 tokens x 2 ranks = 192) are on every tp rank: all-reduce forward and backward,
    # and the forward's again under full recompute.
    plain = expert_tensor_parallel_records(MOE, deg, Job(seq_len=96, recompute="full"))
    assert [(r.op, r.payload_bytes) for r in plain] == [("all_reduce", 192 * 512)] * 3
    assert expert_tensor_parallel_records(MOE, Degrees(tp=2, dp=2, ep=2), Job(seq_len=96)) == []
    # One step with 2 MoE layers (of 4) adds these records twice per micro-batch.
    job = Job(seq_len=96, sequence_parallel=True)
    with_etp, without = summarize(step_records(MOE, deg, job)), summarize(step_records(MOE, Degrees(
        tp=2, dp=2, ep=2), job))
    assert with_etp["all_gather/etp"]["calls"] == 2 * 4 and "all_gather/etp" not in without


def test_pp_sends_and_receives():
    deg = Degrees(pp=4)
    job = Job(seq_len=64)
    a = 2 * 64 * DENSE.hidden_size
    assert keys(pipeline_records(DENSE, deg, job, 0)) == {"send_recv/pp": 2}
    middle = pipeline_records(DENSE, deg, job, 1)
    assert sum(r.bytes_sent for r in middle) == 2 * a and sum(r.bytes_received for r in middle) == 2 * a
    inter = Job(seq_len=64, global_batch=4, pp_schedule="interleaved", virtual_stages=2)
    assert len(pipeline_records(ModelSpec(**{**DENSE.__dict__, "num_layers": 8}), deg, inter, 0)) == 6


def test_step_records_compose():
    deg = Degrees(tp=2, cp=2, pp=2, dp=2, ep=2)
    job = Job(seq_len=64, global_batch=4, sequence_parallel=True, distributed_optimizer=True)
    got = keys(step_records(MOE, deg, job, stage=0))
    m = job.replica_microbatches(deg)  # 2
    # Stage 0 holds layers 0, 1 (layer 1 is MoE with moe_layer_freq=2).
    assert got["all_to_all/ep"] == 8 * m  # counts, rows, ids, weights, combine; and 3 backward
    assert got["send_recv/cp"] == 2 * (3 * 2 - 2) * m
    assert got["send_recv/pp"] == 2 * m
    # 4 in the dense layer, 2 in the MoE layer (no shared expert: only attention splits), 1 for the embedding.
    assert got["reduce_scatter/tp"] == (4 + 2 + 1) * m
    for record in step_records(MOE, deg, job, stage=0):
        assert record.op in cf.OPS
        assert record.dim in {"tp", "cp", "pp", "dp", "ep", "edp", "dp_cp", "tp_cp"}


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding_and_loss_records_by_hand(sp):
    """tp=2, one stage: embedding sum, output-layer gather (SP) and the two cross-entropy reductions."""
    from orangetron.plan.traffic import _vocab_records

    model = ModelSpec(name="m", hidden_size=64, num_layers=2, num_heads=4, vocab_size=256, ffn_hidden_size=128)
    job = Job(seq_len=16, micro_batch=2, sequence_parallel=sp, param_dtype="bfloat16")
    act = 16 * 2 * 64 * 2  # [s, b, h] in bf16
    per_token = 16 * 2 * 4  # one fp32 number per token: the max; then sum of exp and target logit, two

    def rec(op, payload):
        share = payload // 2 * (2 if op == "all_reduce" else 1)
        return (op, payload, share)

    got = [(r.op, r.payload_bytes, r.bytes_sent) for r in _vocab_records(model, Degrees(tp=2), job, 0)]
    if sp:
        want = [rec("reduce_scatter", act), rec("all_gather", act),  # embedding: forward, backward
                rec("all_gather", act), rec("all_gather", act), rec("reduce_scatter", act)]  # output layer
    else:
        want = [rec("all_reduce", act), rec("all_reduce", act)]
    assert got == want + [rec("all_reduce", per_token), rec("all_reduce", 2 * per_token)]


# ---- tensor parallelism's once-per-step gradient sums, by hand ------------------------------------------
# hidden 16, 8 query heads of dim 2, 2 kv heads (fewer than tp=4: replicated), 3 layers, layer 1 MoE with 3
# experts of width 4 and no shared expert.
TP_MODEL = ModelSpec(name="tp", hidden_size=16, num_layers=3, num_heads=8, num_kv_heads=2, vocab_size=32,
                     ffn_hidden_size=24, num_experts=3, top_k=1, moe_ffn_hidden_size=4, moe_layer_freq=2)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_grad_sums_by_hand(sp):
    from orangetron.plan.traffic import tensor_parallel_grad_records

    job = Job(seq_len=8, sequence_parallel=sp, param_dtype="float32", clip_grad=True)
    kv_slots = 3 * (2 * 2 * 2 * 16)  # per layer: K and V, 2 kv heads x dim 2 x hidden 16 (each rank's in its slot)
    replicated = 3 * 2 * 16 + (3 * 16 + 3 * 3 * 16 * 4) + 16  # norms, router + experts of layer 1, final norm
    numel = kv_slots + (replicated if sp else 0)  # 384 + 736 with SP
    payload = 4 * numel  # float32
    got = [(r.op, r.dim, r.payload_bytes, r.bytes_sent) for r in tensor_parallel_grad_records(TP_MODEL,
                                                                                             Degrees(tp=4), job)]
    # all-reduce over 4 ranks: twice 3/4 of the payload; the clip's sum of squares is one float32.
    assert got == [("all_reduce", "tp", payload, 2 * (3 * payload // 4)), ("all_reduce", "tp", 4, 6)]
    assert payload == (4480 if sp else 1536)
    # With no data parallelism the tp sum's concatenation and its out-of-place sum are the reduction buffers.
    assert stage_memory(TP_MODEL, Degrees(tp=4), job, 0)["grad_buckets"] == 2 * payload


def test_replicated_kv_heads_keep_one_head_per_rank():
    # Per layer and rank: q and o split 4 ways (2 * 256 / 4), one kv head's K and V whole (2 * 2 * 16),
    # both norms; the dense MLP (layers 0, 2) split 4 ways (3 * 16 * 24 / 4); layer 1's router and experts
    # whole. Stage 0 of 1 also holds the vocabulary split (32 * 16 / 4 twice: embedding and output).
    attention = 2 * 256 // 4 + 2 * 2 * 16 + 2 * 16
    expected_dense = 3 * attention + 2 * (3 * 16 * 24 // 4) + 3 * 16 + 2 * (32 * 16 // 4) + 16
    params = stage_params(TP_MODEL, Degrees(tp=4), stage=0)
    assert params.dense == expected_dense
    assert params.expert == 3 * 3 * 16 * 4
