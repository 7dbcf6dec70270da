"""The search's caches: keys that drop options must not change any result, warm or cold.

Each cached piece is compared with the same quantity computed without its cache, from the configuration's
own job: model-state memory, the data-parallel step time, the interleaved activation peak (against a walk of
the whole schedule), and whole searches run cold and after another search has filled the caches.
"""

import gc
import pickle
import random
from dataclasses import fields, replace

import pytest

from orangetron.plan import activations, memory, param_grads, search, timing, traffic
from orangetron.plan.activations import _interleaved_holdings, stage_activation_bytes
from orangetron.plan.fp8 import fp8_memory_bytes
from orangetron.plan.memory import (
    data_parallel_segments,
    grad_bucket_bytes,
    model_state_bytes,
    stage_memory,
    stage_params,
    zero3_gather_bytes,
)
from orangetron.plan.network import DEFAULT_PARAMS
from orangetron.plan.search import SearchSpace
from orangetron.plan.traffic import data_parallel_records
from orangetron.spec import keys, options, stages
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import load_model
from orangetron.spec.options import Degrees, Job
from orangetron.spec.schedule import actions

# Options the normalized keys drop, each changed from the job that warms the cache.
ACTIVATION_ONLY = [dict(seq_len=2048), dict(micro_batch=2), dict(global_batch=48), dict(recompute="full"),
                   dict(cp_mode="allgather"), dict(dispatcher="capacity", capacity_factor=1.25),
                   dict(sequence_parallel=True), dict(attention_kernel="eager"), dict(fp8=True),
                   dict(cp_mode="usp", ulysses_degree=2), dict(ep_overlap_chunks=2),
                   dict(recompute="full", recompute_layers=1),
                   dict(dispatcher="deepep", ep_comm_sms_reserved=True)]
SHARDING = [dict(), dict(zero_stage=1), dict(distributed_optimizer=True, grad_bucket_numel=3_000_001),
            dict(zero_stage=2, reduce_dtype="float32"), dict(zero_stage=3), dict(zero_stage=3, zero3_keep_params=True),
            dict(zero_stage=3, zero3_prefetch=False, clip_grad=True), dict(zero_stage=1, clip_grad=True),
            dict(zero_stage=2, grad_bucket_numel=2_000_003), dict(zero_stage=3, zero3_reduce_every_microbatch=True),
            dict(grad_accumulation_fusion=True), dict(distributed_optimizer=True, grad_bucket_numel=3_000_001,
                                                      grad_accumulation_fusion=True)]


def _clear_caches() -> None:
    for module in (activations, options, memory, param_grads, search, stages, timing, traffic):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def _layouts():
    dense, moe = load_model("llama3-8b"), load_model("mixtral-8x7b")
    return [(dense, Degrees(tp=2, pp=4, dp=3)), (dense, Degrees(tp=4, cp=2, pp=3, dp=2)),
            (moe, Degrees(tp=2, pp=2, dp=6, ep=2)), (moe, Degrees(tp=1, pp=4, dp=4, ep=4))]


def _state_reference(model, deg, job, stage) -> dict[str, int]:
    """The breakdown from the category functions, called with the job itself (nothing keyed or cached)."""
    out = model_state_bytes(stage_params(model, deg, stage, job.virtual_stages), deg, job,
                            data_parallel_segments(model, deg, job, stage))
    out["activations"] = stage_activation_bytes(model, deg, job, stage)
    out["gathered_params"] = zero3_gather_bytes(model, deg, job, stage)
    out["grad_buckets"] = grad_bucket_bytes(model, deg, job, stage)
    for cached in (param_grads.stage_tensors, param_grads._totals, param_grads._replayed_peak):
        cached.cache_clear()  # cold: the gradient peak from this job alone
    out["param_grads"] = param_grads.param_grad_bytes(model, deg, job, stage)
    out["buffers"] = out["gathered_params"] + out["grad_buckets"] + out["param_grads"]
    out["total"] = sum(out[c] for c in memory.CATEGORIES) + out["buffers"]
    if job.fp8:
        out["fp8"] = fp8_memory_bytes(model, deg, job, stage)
        out["total"] += out["fp8"]
    return out


def test_stage_memory_cached_by_model_states_equals_each_jobs_own_breakdown():
    _clear_caches()
    for model, deg in _layouts():
        for sharding in SHARDING:
            warm = Job(seq_len=4096, global_batch=96, **sharding)
            for stage in range(deg.pp):
                stage_memory(model, deg, warm, stage)  # fills the cache under the shared key
            for change in ACTIVATION_ONLY:
                if "dispatcher" in change and not model.is_moe:
                    continue
                job = replace(warm, **change)
                for stage in range(deg.pp):
                    assert stage_memory(model, deg, job, stage) == _state_reference(model, deg, job, stage), \
                        (model.name, deg, job, stage)


def _plain_sum(records, places, cluster) -> tuple[float, float]:
    """Reductions and gathers priced one record at a time, added in order."""
    reduce = gather = 0.0
    for r in records:
        t = timing._record_time(r, places[r.dim], cluster, DEFAULT_PARAMS, 0.0)
        if r.op == "all_gather":
            gather += t
        else:
            reduce += t
    return reduce, gather


def test_data_parallel_time_cached_by_model_states_equals_a_plain_sum_over_each_jobs_records():
    _clear_caches()
    cluster = make_cluster("h100", 48)
    for model, deg in _layouts():
        deg = replace(deg, dp=48 // (deg.tp * deg.cp * deg.pp))
        places = timing.group_places(deg, cluster)
        for sharding in SHARDING:
            warm = Job(seq_len=4096, global_batch=96, **sharding)
            timing._dp_exposed(model, deg, warm, cluster, 1.0, warm.replica_microbatches(deg), DEFAULT_PARAMS,
                               timing.DEFAULT_EFFICIENCY)
            for change in ACTIVATION_ONLY:
                job = replace(warm, **change)
                if job.global_batch % (job.micro_batch * deg.dp) or "dispatcher" in change and not model.is_moe:
                    continue
                key = timing._data_parallel_job(model, deg, job, job.replica_microbatches(deg))
                reduce, gather, _ = timing._dp_times(model, deg, key, cluster, DEFAULT_PARAMS)
                # Bit for bit: the cache must not even change the order of the additions.
                assert (reduce, gather) == _plain_sum(data_parallel_records(model, deg, job), places, cluster), \
                    (model.name, deg, job)


@pytest.mark.parametrize("pp,v", [(2, 2), (3, 2), (4, 3)])
def test_interleaved_holdings_give_the_peak_of_a_walk_over_the_whole_schedule(pp, v):
    """For any non-negative sizes, and a replay transient of each chunk's own that comes on top of what its
    backward finds held, the largest value of the kept holdings is the peak of the walk of every action of the
    full schedule (not only its prefix). A transient added to the largest holding of all instead missed a peak
    while an earlier chunk's backward replayed with fewer later chunks held (trial I: 32 bytes, one micro-batch's
    padding mask, on the last stage of an interleaved MoE run at m = 2 pp)."""
    rng = random.Random(pp * 10 + v)
    for m in (pp, 3 * pp, 40 * pp + pp):  # the last is longer than the prefix the holdings walk
        full = actions(pp, m, "interleaved", v)
        for stage in range(pp):
            for masked in {tuple(rng.random() < 0.5 for _ in range(v)), (False,) * v, (True,) * v}:
                held = _interleaved_holdings(pp, m, v, stage, masked)
                for _ in range(5):
                    sizes = [rng.randrange(0, 1000) for _ in range(v + 1)]
                    replays = [rng.randrange(0, 3000) for _ in range(v)]
                    chunks, holders, peak = [0] * v, [0] * m, 0
                    for act in full[stage]:
                        live = sum(n * s for n, s in zip(chunks, sizes, strict=False))
                        if act.kind != "F":
                            peak = max(peak, live + sizes[v] * sum(h > 0 for h in holders) + replays[act.chunk])
                        sign = 1 if act.kind == "F" else -1
                        chunks[act.chunk] += sign
                        if masked[act.chunk]:
                            holders[act.microbatch] += sign
                        live = sum(n * s for n, s in zip(chunks, sizes, strict=False))
                        peak = max(peak, live + sizes[v] * sum(h > 0 for h in holders))
                    best = max(sum(n * s for n, s in zip(counts, sizes, strict=True))
                               + (replays[tag] if tag >= 0 else 0) for tag, *counts in held)
                    assert best == peak, (pp, v, m, stage, masked, sizes, replays)


def _search_json(model, cluster, seq_len, global_batch, space):
    result = search.search(model, cluster, seq_len, global_batch, space=space, top=20)
    return result.considered, result.evaluated, [e.to_json() for e in result.ranked], \
        [(e.memory, e.time) for e in result.ranked]


@pytest.mark.parametrize("name,gpus,space", [
    ("llama3-8b", 16, SearchSpace(micro_batch=(1, 2))),
    ("mixtral-8x7b", 16, SearchSpace(tp=(1, 2), pp=(1, 2, 4), micro_batch=(1, 2))),
])
def test_search_after_another_search_equals_a_cold_search(name, gpus, space):
    """Another search (other batch and sequence, same model and cluster) fills every cache with keys this one
    shares; the ranking, memory and times must equal those of a search that starts with empty caches."""
    model, cluster = load_model(name), make_cluster("h100", gpus)
    _clear_caches()
    cold = _search_json(model, cluster, 4096, 64, space)
    _clear_caches()
    search.search(model, cluster, 2048, 32, space=space)
    assert _search_json(model, cluster, 4096, 64, space) == cold
    assert cold[2]  # something fits


def test_hashed_once_descriptions_stay_equal_to_their_copies_and_pickles():
    job, model, cluster = Job(seq_len=4096, zero_stage=1), load_model("llama3-8b"), make_cluster("h100", 16)
    for obj in (job, model, cluster):
        first = hash(obj)
        for copy in (pickle.loads(pickle.dumps(obj)), replace(obj)):
            assert copy == obj and hash(copy) == first and {obj: 1}[copy] == 1
        assert set(vars(obj)) == {f.name for f in fields(obj)}  # nothing added to what `__dict__` users read
    # A freed object's hash goes with it: a new object may get its id.
    temporary = Job(seq_len=123)
    hash(temporary)
    key = id(temporary)
    assert key in keys._HASHES
    del temporary
    gc.collect()
    assert key not in keys._HASHES


def test_the_model_state_floor_bounds_every_total_and_prunes_only_what_does_not_fit(monkeypatch):
    """The search drops a layout whose model states alone overflow before pricing its activations: the floor
    must never exceed the busiest stage's total, and a search without it must rank the same layouts."""
    for model, deg in _layouts():
        for sharding in SHARDING:
            for change in ({}, *ACTIVATION_ONLY[:4]):
                job = replace(Job(seq_len=4096, global_batch=96, **sharding), **change)
                total = memory.memory_per_gpu(model, deg, job)["total"]
                assert 0 < memory.model_state_floor(model, deg, job) <= total, (model.name, deg, job)
    model, cluster = load_model("mixtral-8x7b"), make_cluster("h100", 16)
    space = SearchSpace(tp=(1, 2), pp=(1, 2, 4), micro_batch=(1, 2))
    floor, pruned = memory.model_state_floor, []

    def counting_floor(model, deg, job):
        value = floor(model, deg, job)
        pruned.append(value + search.DEFAULT_OVERHEAD.fixed_bytes(deg) > cluster.gpu.memory_bytes)
        return value

    monkeypatch.setattr(search, "model_state_floor", counting_floor)
    _clear_caches()
    with_floor = _search_json(model, cluster, 4096, 64, space)
    assert any(pruned) and not all(pruned)  # the floor decided something here
    monkeypatch.setattr(search, "model_state_floor", lambda model, deg, job: 0)
    _clear_caches()
    assert _search_json(model, cluster, 4096, 64, space) == with_floor
