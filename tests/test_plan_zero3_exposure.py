"""ZeRO-3's exposed data-parallel time, unit by unit (`plan/zero3_exposure.py`): three hand-made units worked
through by hand, the units' transfers against the step's records, and what the mechanism does to a real layout
(the first units that nothing hides, prefetch, kept parameters)."""

from dataclasses import replace

import pytest

from orangetron.plan import timing, zero3_exposure
from orangetron.plan.network import DEFAULT_PARAMS
from orangetron.plan.traffic import data_parallel_records, zero3_unit_records
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import load_model
from orangetron.spec.options import Degrees, Job

U = zero3_exposure.UnitTraffic
# An embedding-like unit with no compute, then two layers; contention 0.1.
UNITS = [U(gather=1.0, reduce=2.0, share=0.0), U(gather=3.0, reduce=1.0, share=0.5),
         U(gather=2.0, reduce=4.0, share=0.5)]
C = 0.1


def test_forward_by_hand():
    """Forward of 4 s (windows 0, 2, 2): the first gather waits whole, the second hides behind the first unit's
    nothing, the third behind 2 s of the second unit's compute (0.1 x 2 of contention). Without prefetch every
    gather waits."""
    assert zero3_exposure.forward_exposed(UNITS, 4.0, True, C) == pytest.approx(1 + 3 + 0.2)
    assert zero3_exposure.forward_exposed(UNITS, 4.0, False, C) == pytest.approx(1 + 3 + 2)


def test_backward_by_hand():
    """Backward of 8 s, units in reverse (windows 4, 4, 0). Reducing: the last unit's gather waits (2); behind
    it the middle unit's gather (3 in 4: 0.3); behind the middle unit the first unit's gather and the last
    unit's reduce-scatter (1 + 4 in 4: 1 + 0.4); behind the first unit's nothing the middle unit's reduce-scatter
    (1); the first unit's reduce-scatter (2) after the pass. Not reducing: 2 + 0.3 + 0.1. Kept parameters: only
    the reduce-scatters. Without prefetch every gather waits."""
    back = UNITS[::-1]
    assert zero3_exposure.backward_exposed(back, 8.0, True, True, True, C) == pytest.approx((2 + 0.3 + 1.4 + 1, 2))
    assert zero3_exposure.backward_exposed(back, 8.0, True, False, True, C) == pytest.approx((2.4, 0))
    assert zero3_exposure.backward_exposed(back, 8.0, False, True, True, C) == pytest.approx((0.4 + 1, 2))
    assert zero3_exposure.backward_exposed(back, 8.0, True, True, False, C) == pytest.approx((2 + 3 + 1 + 0.4 + 1, 2))


def test_step_by_hand():
    """Three micro-batches (forward 4.2 each). One reducing round: two quiet backward passes (2.4), one busy
    (4.7) and its tail (2), which the pass waits for. Three rounds: three busy passes, each with its tail. No
    overlap: quiet passes, then every reduce-scatter of the round (7)."""
    def step(rounds: int, overlap: bool = True) -> float:
        return zero3_exposure.step_exposed(UNITS, UNITS[::-1], 4.0, 8.0, 3, rounds, True, False, overlap, C)

    assert step(1) == pytest.approx(3 * 4.2 + 2 * 2.4 + 4.7 + 2)
    assert step(3) == pytest.approx(3 * 4.2 + 3 * (4.7 + 2))
    assert step(1, overlap=False) == pytest.approx(3 * 4.2 + 3 * 2.4 + 7)
    assert zero3_exposure.step_exposed([], [], 4.0, 8.0, 3, 1, True, False, True, C) == 0.0


LAYOUTS = [
    ("llama3-8b", Degrees(dp=8), Job(seq_len=4096, global_batch=32, zero_stage=3)),
    ("llama3-8b", Degrees(dp=4, cp=2), Job(seq_len=8192, global_batch=16, zero_stage=3, zero3_keep_params=True)),
    ("tiny", Degrees(dp=4), Job(seq_len=256, global_batch=16, zero_stage=3, zero3_reduce_every_microbatch=True,
                                 param_dtype="float32")),
    ("mixtral-8x7b", Degrees(dp=8, ep=4), Job(seq_len=4096, global_batch=32, zero_stage=3)),
    ("deepseek-v3", Degrees(pp=4, dp=16, ep=8), Job(seq_len=4096, global_batch=64, zero_stage=3)),
]


@pytest.mark.parametrize(("name", "deg", "job"), LAYOUTS, ids=[f"{n}-{d}" for n, d, _ in LAYOUTS])
def test_units_carry_every_byte_of_the_steps_records(name, deg, job):
    """The units' one-pass transfers, repeated per pass (two gathers a micro-batch, one when kept) and per
    reducing round, are the step's ZeRO-3 records to the byte, on every stage."""
    model = load_model(name)
    m = job.replica_microbatches(deg)
    rounds = timing.reduce_rounds(model, deg, job)
    for stage in range(deg.pp):
        step = data_parallel_records(model, deg, job, stage)
        units = zero3_unit_records(model, deg, job, stage)
        passes = {"all_gather": m * (1 if job.zero3_keep_params else 2), "reduce_scatter": rounds}
        for op, times in passes.items():
            want = sum(r.bytes_sent for r in step if r.op == op)
            assert sum(r.bytes_sent for rs in units for r in rs if r.op == op) * times == want, (stage, op)


MODEL, CLUSTER, DEG = load_model("llama3-8b"), make_cluster("h100", 128), Degrees(dp=128)
JOB = Job(seq_len=8192, micro_batch=2, global_batch=256, zero_stage=3, recompute="full")


def test_units_split_the_compute_by_forward_flops():
    """The embedding computes nothing; the 32 layers share alike; the head's share is 2 x hidden x vocabulary
    per token of the whole."""
    dp_job = timing._data_parallel_job(MODEL, DEG, JOB, 1)
    units, backward = timing._zero3_units(MODEL, DEG, dp_job, CLUSTER, DEFAULT_PARAMS, 0, JOB.seq_len)
    assert backward == units[::-1]
    assert len(units) == 34 and units[0].share == 0
    assert len({round(u.share, 15) for u in units[1:-1]}) == 1
    layer = timing._layer_forward_flops(MODEL, 0, JOB.seq_len)
    head = 2.0 * MODEL.hidden_size * MODEL.vocab_size
    assert units[-1].share == pytest.approx(head / (32 * layer + head), rel=1e-12)
    assert sum(u.share for u in units) == pytest.approx(1.0, rel=1e-12)


def test_what_no_compute_hides_stays_exposed():
    """However long the compute, the embedding's gather (first), the first layer's (prefetched while the
    embedding computes nothing) and the head's (first in backward) wait in every pass, and the first unit's
    reduce-scatter after the last one: the old whole-step overlap let compute hide them all."""
    m = JOB.replica_microbatches(DEG)
    dp_job = timing._data_parallel_job(MODEL, DEG, JOB, m)
    units, _ = timing._zero3_units(MODEL, DEG, dp_job, CLUSTER, DEFAULT_PARAMS, 0, JOB.seq_len)
    floor = m * (units[0].gather + units[1].gather + units[-1].gather) + units[0].reduce
    exposed = timing._dp_exposed(MODEL, DEG, JOB, CLUSTER, 1e6, m, DEFAULT_PARAMS, timing.DEFAULT_EFFICIENCY)
    assert exposed > floor > 0


def test_prefetch_and_kept_parameters_move_the_step():
    """Without prefetch every gather waits: slower. Kept parameters skip the backward's gathers: faster."""
    base = timing.step_time(MODEL, DEG, JOB, CLUSTER)
    no_prefetch = timing.step_time(MODEL, DEG, replace(JOB, zero3_prefetch=False), CLUSTER)
    kept = timing.step_time(MODEL, DEG, replace(JOB, zero3_keep_params=True), CLUSTER)
    assert no_prefetch.dp_s > 2 * base.dp_s and kept.dp_s < base.dp_s
    assert no_prefetch.compute_s == base.compute_s == kept.compute_s


def test_a_unit_gathered_for_the_whole_pass_comes_first_in_both():
    """Where the embedding and the head are not units of their own (tied embeddings; a pipeline stage's first or
    last), they form one unit gathered at the start of forward and of backward (`parallel.data.units`): first in
    both orders. In forward it hides nothing before the layers (the head runs after them); in backward its
    head computes first, hiding the last layer's gather. Holding the embedding, whose gradient comes last, its
    reduce-scatter ends backward; holding the head alone, it follows the head's backward."""
    tied = replace(load_model("llama3-8b"), tied_embeddings=True)
    dp_job = timing._data_parallel_job(tied, DEG, JOB, 1)
    forward, backward = timing._zero3_units(tied, DEG, dp_job, CLUSTER, DEFAULT_PARAMS, 0, JOB.seq_len)
    rest, layers = backward[0], forward[1:]
    assert forward[0] == replace(rest, share=0.0, reduce=backward[-1].reduce) and rest.reduce == 0
    assert rest.share > 0 and backward[1:-1] == layers[::-1]
    assert backward[-1].gather == backward[-1].share == 0 and backward[-1].reduce > 0

    deg = Degrees(pp=2, dp=64)
    for stage in (0, 1):
        dp_job = timing._data_parallel_job(MODEL, deg, JOB, 1)
        forward, backward = timing._zero3_units(MODEL, deg, dp_job, CLUSTER, DEFAULT_PARAMS, stage, JOB.seq_len)
        assert forward[0].share == 0 and backward[0].gather == forward[0].gather
        if stage == 0:  # the embedding: no compute, its reduce-scatter last
            assert backward[0].share == 0 and backward[0].reduce == 0 and backward[-1].reduce == forward[0].reduce
        else:  # the head: computes first in backward and is reduced after it
            assert backward[0].share > 0 and backward[0].reduce == forward[0].reduce and backward[1:] == forward[:0:-1]


def test_partial_gradients_summed_over_tp_hold_every_reduction_to_the_step():
    """With sequence parallelism over tp the runtime sums partial gradients over tp at the step, so the units'
    reduce-scatters cannot overlap backward: the same layout without sequence parallelism exposes less, by
    about the hidden reductions' worth, which is positive."""
    deg, job = Degrees(tp=2, dp=64), replace(JOB, sequence_parallel=False)
    summed = timing.step_time(MODEL, deg, replace(job, sequence_parallel=True), CLUSTER)
    plain = timing.step_time(MODEL, deg, job, CLUSTER)
    assert summed.dp_s > plain.dp_s
