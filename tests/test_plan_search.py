"""Layout search: what it enumerates, what it keeps, how it ranks."""

from dataclasses import replace

from orangetron.plan.estimate import estimate
from orangetron.plan.overhead import DEFAULT_OVERHEAD
from orangetron.plan.search import SearchSpace, candidate_degrees, candidate_jobs, search
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import load_model
from orangetron.spec.options import Degrees, Job

# Scenarios set at the edge of memory when the fit check counted the whole fragmentation fraction keep that check:
# they test the search's rules; what the check counts is tested in tests/test_plan_overhead.py.
WHOLE_FRACTION = replace(DEFAULT_OVERHEAD, pressured_fraction=DEFAULT_OVERHEAD.fraction)


def test_candidate_degrees_cover_the_cluster():
    model, cluster = load_model("mixtral-8x7b"), make_cluster("h100", 32)
    degrees = list(candidate_degrees(model, cluster, SearchSpace()))
    assert all(d.world_size == 32 and d.tp <= 8 for d in degrees)
    unfolded = [d for d in degrees if not d.expert_fold]
    assert all((d.dp * d.cp) % d.ep == 0 and model.num_experts % d.ep == 0 for d in unfolded)
    assert Degrees(tp=2, cp=1, pp=2, dp=8, ep=8) in degrees
    assert len(unfolded) > 50
    # Folded expert meshes only where folding allows a new ep: tp=8, dp=4 on 32 GPUs can fold ep=8 over the 32
    # ranks of its stage (dp x cp = 4 cannot hold it); ep = 4 there is left to the unfolded layout.
    folded = [d for d in degrees if d.expert_fold]
    assert Degrees(tp=8, dp=4, ep=8, expert_fold=True) in folded
    assert Degrees(tp=8, dp=4, ep=4, expert_fold=True) not in folded
    assert all((d.dp * d.cp) % d.ep and (d.tp * d.cp * d.dp) % d.ep == 0 and d.etp == 1 for d in folded)


def test_search_ranks_a_folded_layout_it_can_price():
    """Mixtral on 16 H100 with tp = 4 and pp = 1: only a folded mesh reaches ep = 8; the search prices it."""
    model, cluster = load_model("mixtral-8x7b"), make_cluster("h100", 16)
    space = SearchSpace(tp=(4,), pp=(1,), cp=(1,), micro_batch=(1,))
    result = search(model, cluster, seq_len=4096, global_batch=64, space=space, top=50)
    assert any(e.degrees.expert_fold and e.degrees.ep == 8 for e in result.ranked)


def test_search_ranks_fitting_configurations_fastest_first():
    model, cluster = load_model("llama3-8b"), make_cluster("h100", 16)
    result = search(model, cluster, seq_len=8192, global_batch=64, top=8, memory_fraction=0.9)
    times = [e.time.step_s for e in result.ranked]
    assert times == sorted(times)
    assert all(e.memory["needed"] <= 0.9 * cluster.gpu.memory_bytes for e in result.ranked)
    assert result.considered > 1000  # thousands of configurations, priced in about a second
    # The winner is at least as fast as a sensible hand-written layout.
    manual = estimate(model, Degrees(tp=2, dp=8), Job(seq_len=8192, global_batch=64, sequence_parallel=True,
                                                      distributed_optimizer=True), cluster)
    assert result.ranked[0].time.step_s <= manual.time.step_s


def test_restricted_space_is_respected():
    model, cluster = load_model("llama3-70b"), make_cluster("h100", 64)
    space = SearchSpace(tp=(8,), pp=(2,), cp=(1,), micro_batch=(1,), zero=("distopt",), recompute=("full",))
    result = search(model, cluster, seq_len=4096, global_batch=64, space=space, top=3)
    assert result.ranked
    for e in result.ranked:
        assert (e.degrees.tp, e.degrees.pp, e.degrees.cp) == (8, 2, 1)
        assert e.job.distributed_optimizer and e.job.recompute == "full"


def test_search_keeps_a_layout_that_needs_less_than_the_gpu_though_it_reserves_more_with_room():
    """Llama 3 8B, ZeRO-3 on 8 H100, no recompute: 75.5 GiB needed, 84.9 GiB with the whole fraction, on 79.65 GiB;
    the search judges on the need."""
    model, cluster = load_model("llama3-8b"), make_cluster("h100", 8)
    space = SearchSpace(tp=(1,), cp=(1,), pp=(1,), micro_batch=(1,), zero=("zero3",), recompute=("none",))
    (only,) = search(model, cluster, 8192, 64, space=space, top=3).ranked
    assert only.memory["needed"] <= cluster.gpu.memory_bytes < only.memory["total"]
    assert search(model, cluster, 8192, 64, space=space, overhead=WHOLE_FRACTION).ranked == []


def test_search_prices_gradient_buckets_beside_reducing_after_backward():
    """Llama 3 8B on 16 H100, full recompute: every layout but ZeRO-3 is also searched with 40M-element buckets,
    which hide the reduction behind backward (and under ZeRO-2 free each .grad once its bucket is reduced): the
    bucketed twin is kept beside the unbucketed one, is faster, and is the fastest layout. Without buckets in the
    space, none is."""
    model, cluster = load_model("llama3-8b"), make_cluster("h100", 16)
    space = SearchSpace(tp=(1,), cp=(1,), pp=(1,), micro_batch=(1,), recompute=("full",), zero=("zero2", "zero3"))
    ranked = search(model, cluster, 8192, 64, space=space, top=10).ranked
    by_bucket = {(e.job.zero_stage, e.job.grad_bucket_numel): e for e in ranked}
    assert set(by_bucket) == {(2, 0), (2, 40_000_000), (3, 0)}
    bucketed, after = by_bucket[(2, 40_000_000)], by_bucket[(2, 0)]
    assert bucketed.time.step_s < after.time.step_s and bucketed.time.dp_s < after.time.dp_s
    assert ranked[0] is bucketed
    jobs = [j for group in candidate_jobs(model, Degrees(dp=16), 8192, 64, space, Job(seq_len=8192)) for j in group]
    assert {j.grad_bucket_numel for j in jobs} == {0, 40_000_000}
    assert not [j for j in jobs if j.zero_stage == 3 and j.grad_bucket_numel]  # ZeRO-3 reduces unit by unit
    assert {j.grad_bucket_numel for group in candidate_jobs(model, Degrees(tp=16), 8192, 64, space,
                                                            Job(seq_len=8192)) for j in group} == {0}
    plain = search(model, cluster, 8192, 64, space=replace(space, grad_bucket_numel=(0,)), top=10).ranked
    assert {e.job.grad_bucket_numel for e in plain} == {0} and len(plain) == 2


def test_search_reduces_zero3_every_micro_batch_where_whole_gradients_do_not_fit():
    """Llama 3 8B on 8 H100 at 8192 tokens, 64 sequences, the whole fraction counted: ZeRO-3 fits only when each
    micro-batch is reduce-scattered (one unit's .grad at a time); accumulating whole .grad tensors adds 16 GB per
    GPU."""
    from orangetron.plan.memory import memory_per_gpu
    from orangetron.plan.overhead import with_overhead

    model, cluster = load_model("llama3-8b"), make_cluster("h100", 8)
    unbucketed = SearchSpace(grad_bucket_numel=(0,))  # ZeRO-2 in buckets would win here
    best = search(model, cluster, 8192, 64, space=unbucketed, overhead=WHOLE_FRACTION).ranked[0]
    assert best.job.zero_stage == 3 and best.job.zero3_reduce_every_microbatch
    assert best.job.replica_microbatches(best.degrees) > 1
    whole = replace(best.job, zero3_reduce_every_microbatch=False)
    total = with_overhead(memory_per_gpu(model, best.degrees, whole), best.degrees, WHOLE_FRACTION)["needed"]
    assert total > cluster.gpu.memory_bytes
    assert memory_per_gpu(model, best.degrees, whole)["param_grads"] == 8_030_261_248 * 2


def test_search_replays_as_few_layers_as_the_memory_needs():
    """Llama 3 70B on 64 H100 at tp 8 pp 2 (40 layers a stage), distributed optimizer, 8192 tokens: without
    recompute a stage holds too much; the search replays the fewest leading layers per stage that fit, which a
    scan over every count confirms, and is faster than replaying all of them."""
    from orangetron.plan.memory import memory_per_gpu
    from orangetron.plan.overhead import DEFAULT_OVERHEAD, with_overhead

    model, cluster = load_model("llama3-70b"), make_cluster("h100", 64)
    space = SearchSpace(tp=(8,), pp=(2,), cp=(1,), virtual_stages=(1,), micro_batch=(1,), zero=("distopt",),
                        grad_bucket_numel=(0,))
    best = search(model, cluster, seq_len=8192, global_batch=64, space=space, top=1).ranked[0]
    assert best.job.recompute == "full" and 0 < best.job.recompute_layers < 40

    def fits(job):
        return with_overhead(memory_per_gpu(model, best.degrees, job), best.degrees,
                             DEFAULT_OVERHEAD)["needed"] <= cluster.gpu.memory_bytes

    assert not fits(replace(best.job, recompute="none", recompute_layers=0))
    fitting = [r for r in range(1, 40) if fits(replace(best.job, recompute_layers=r))]
    assert best.job.recompute_layers == min(fitting)
    full = estimate(model, best.degrees, replace(best.job, recompute_layers=0), cluster)
    assert best.time.step_s < full.time.step_s
    off = search(model, cluster, seq_len=8192, global_batch=64, space=replace(space, partial_recompute=False), top=1)
    assert off.ranked[0].job.recompute_layers == 0


def test_partial_recompute_keeps_options_a_uniform_one_would_dominate():
    """Two rules of the uniform search no longer hold once only some layers replay, and the search drops them:
    - a more sharded option moves the same bytes but may need fewer replays (Mixtral on 16 H100: ZeRO-2 replays
      5 layers a chunk where DDP needs 15), so searching every sharding finds what ZeRO-2 alone finds;
    - replaying a few layers may beat selective recompute (eager attention), so offering selective too must not
      make the answer slower."""
    model, cluster = load_model("mixtral-8x7b"), make_cluster("h100", 16)
    space = SearchSpace(tp=(1,), cp=(4,), pp=(2,), ep=(8,), cp_mode=("ring",),
                        zero=("ddp", "zero1", "distopt", "zero2"), recompute=("none", "full"), micro_batch=(1,),
                        virtual_stages=(1,), grad_bucket_numel=(0,))
    every = search(model, cluster, 8192, 64, space=space, top=1).ranked[0]
    zero2 = search(model, cluster, 8192, 64, space=replace(space, zero=("zero2",)), top=1).ranked[0]
    assert every.time.step_s == zero2.time.step_s and every.job.recompute_layers == zero2.job.recompute_layers
    assert every.job.zero_stage == 2 and every.job.recompute_layers > 0

    model, cluster = load_model("llama3-8b"), make_cluster("h100", 8)
    space = SearchSpace(tp=(2,), cp=(4,), pp=(1,), micro_batch=(1,), zero=("distopt",), cp_mode=("ring",),
                        grad_bucket_numel=(0,))
    eager = Job(seq_len=8192, attention_kernel="eager")
    with_selective = search(model, cluster, 8192, 64, space=space, base=eager, top=1,
                            overhead=WHOLE_FRACTION).ranked[0]
    without = search(model, cluster, 8192, 64, space=replace(space, recompute=("none", "full")), base=eager,
                     top=1, overhead=WHOLE_FRACTION).ranked[0]
    assert with_selective.time.step_s == without.time.step_s and without.job.recompute_layers > 0


def test_partial_recompute_reaches_the_top_from_far_behind():
    """Qwen3-30B-A3B on 32 H100 at 16384 tokens, within 35.2 GiB (the whole fraction counted): replaying one layer a
    chunk wins, though replaying all of them takes more than 1.5 times the fastest layout that replays nothing (the
    forward's expert and ring traffic exceed the backward's window). Asked for the top one, the search's cutoff is
    that fastest layout, so a bound on what replays cost (that they add at most half) would prune the winner. The
    compute model is idealized so that this holds by a margin: a host that is never the bottleneck (`host_op_s` 0;
    host pacing hides part of a replay's cost) and hidden communication that costs nothing (`overlap_contention` 0;
    the fastest layout that replays nothing is a ZeRO-3 one, whose hidden gathers would add their contention; with
    the shipped contention the premise falls just short, 1.49 times). The memory bound was set for the preset
    without its QK-norm, which the test keeps off (its saved inputs move the layouts that fit)."""
    from orangetron.plan.timing import DEFAULT_EFFICIENCY
    from orangetron.spec.hardware import GIB

    model, cluster = replace(load_model("qwen3-30b-a3b"), qk_norm=False), make_cluster("h100", 32)
    space = SearchSpace(tp=(2,), cp=(8, 16), pp=(1,), zero=("distopt", "zero3"), micro_batch=(1,),
                        virtual_stages=(1,), cp_mode=("ring", "allgather"), recompute=("none", "full"))
    fraction = 35.2 * GIB / cluster.gpu.memory_bytes
    gpu_bound = replace(DEFAULT_EFFICIENCY, host_op_s=0.0, overlap_contention=0.0)
    (best,) = search(model, cluster, 16384, 128, space=space, top=1, memory_fraction=fraction, eff=gpu_bound,
                     overhead=WHOLE_FRACTION).ranked
    assert best.job.recompute == "full" and best.job.recompute_layers == 1
    (no_replay,) = search(model, cluster, 16384, 128, space=replace(space, recompute=("none",)), top=1,
                          memory_fraction=fraction, eff=gpu_bound, overhead=WHOLE_FRACTION).ranked
    assert no_replay.time.step_s > best.time.step_s
    full = estimate(model, best.degrees, replace(best.job, recompute_layers=0), cluster, eff=gpu_bound)
    assert full.time.step_s > 1.5 * no_replay.time.step_s


def test_fewest_replays_with_uneven_chunks():
    """10 layers over pp 4 (chunks of 3, 3, 2, 2): r runs to 2, one short of the longest chunk; with the memory of
    r = 2 as the limit, 2 is the answer, and with r = 1's, 1."""
    from orangetron.plan.memory import memory_per_gpu
    from orangetron.plan.overhead import DEFAULT_OVERHEAD, with_overhead
    from orangetron.plan.search import fewest_replays_that_fit
    from orangetron.spec.model import ModelSpec

    model = ModelSpec(name="ten", hidden_size=256, num_layers=10, num_heads=4, vocab_size=1000, ffn_hidden_size=1024)
    deg, full = Degrees(pp=4), Job(seq_len=4096, global_batch=8, recompute="full")
    totals = {r: with_overhead(memory_per_gpu(model, deg, Job(seq_len=4096, global_batch=8, recompute="full",
                                                              recompute_layers=r)), deg, DEFAULT_OVERHEAD)["needed"]
              for r in (1, 2)}
    assert totals[1] > totals[2]
    for r in (1, 2):
        assert fewest_replays_that_fit(model, deg, full, totals[r]).recompute_layers == r


def test_candidate_jobs_keep_the_base_jobs_framework_paths():
    """The search varies layouts, sharding, recompute and micro-batches, not how the framework runs: a base job
    whose experts' transfers hide behind nothing, whose reductions wait for the step and whose Adam moments are
    bfloat16 stays so in every candidate (only the experts' overlap switches were kept until 2026-12-05)."""
    model = load_model("deepseek-v2")
    paths = dict(overlap_ep=False, overlap_shared_experts=False, overlap_grad_reduce=False,
                 optimizer_state_dtype="bfloat16", tp_sum_with_reduction=True, eager_fp32_loss=True,
                 recompute_modules=("layernorm",))
    base = Job(seq_len=4096, **paths)
    space = SearchSpace(micro_batch=(1, 2), recompute=("none", "full"), zero=("distopt", "zero3"))
    jobs = [j for group in candidate_jobs(model, Degrees(dp=16, ep=8), 4096, 64, space, base) for j in group]
    assert len(jobs) > 4 and {(j.micro_batch, j.recompute, j.zero_stage) for j in jobs} >= {(1, "none", 0),
                                                                                           (2, "full", 3)}
    full = [j for j in jobs if j.recompute == "full"]
    assert full and all(j.recompute_modules == () for j in full)  # full recompute replays every module already
    assert all(getattr(j, name) == value for j in jobs for name, value in paths.items()
               if name != "recompute_modules" or j.recompute != "full")


def test_search_times_the_sharded_optimizers_apart_from_ddp():
    """ZeRO-1/2 and the distributed optimizer step 1/d of the parameters, DDP all of them, at the same bytes: they
    shared DDP's pricing class and were never timed once DDP fit, so a slower DDP or ZeRO-3 row topped the plan."""
    model, cluster = load_model("llama3-8b"), make_cluster("h100", 16)
    result = search(model, cluster, 4096, 16, SearchSpace(tp=(2,), cp=(1,), pp=(2,)), top=50)
    best = result.ranked[0]
    assert best.job.zero_stage in (1, 2) or best.job.distributed_optimizer
    ddp = estimate(model, best.degrees, replace(best.job, zero_stage=0, distributed_optimizer=False), cluster)
    assert best.time.step_s < ddp.time.step_s  # the optimizer's step, sharded
    assert best.time.step_s == estimate(model, best.degrees, best.job, cluster).time.step_s
