"""Layout search: what it enumerates, what it keeps, how it ranks."""

from orangetron.plan.config import Degrees, Job
from orangetron.plan.estimate import estimate
from orangetron.plan.hardware import make_cluster
from orangetron.plan.models import load_model
from orangetron.plan.search import SearchSpace, candidate_degrees, search


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
    assert all(e.memory["total"] <= 0.9 * cluster.gpu.memory_bytes for e in result.ranked)
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


def test_search_reduces_zero3_every_micro_batch_where_whole_gradients_do_not_fit():
    """Llama 3 8B on 8 H100 at 8192 tokens, 64 sequences: ZeRO-3 fits only when each micro-batch is
    reduce-scattered (one unit's .grad at a time); accumulating whole .grad tensors adds 16 GB per GPU."""
    from dataclasses import replace

    from orangetron.plan.memory import memory_per_gpu
    from orangetron.plan.overhead import DEFAULT_OVERHEAD, with_overhead

    model, cluster = load_model("llama3-8b"), make_cluster("h100", 8)
    best = search(model, cluster, 8192, 64).ranked[0]
    assert best.job.zero_stage == 3 and best.job.zero3_reduce_every_microbatch
    assert best.job.microbatches(best.degrees) > 1
    whole = replace(best.job, zero3_reduce_every_microbatch=False)
    total = with_overhead(memory_per_gpu(model, best.degrees, whole), best.degrees, DEFAULT_OVERHEAD)["total"]
    assert total > cluster.gpu.memory_bytes
    assert memory_per_gpu(model, best.degrees, whole)["param_grads"] == 8_030_261_248 * 2


def test_search_replays_as_few_layers_as_the_memory_needs():
    """Llama 3 70B on 64 H100 at tp 8 pp 2 (40 layers a stage), distributed optimizer, 8192 tokens: without
    recompute a stage holds too much; the search replays the fewest leading layers per stage that fit, which a
    scan over every count confirms, and is faster than replaying all of them."""
    from dataclasses import replace

    from orangetron.plan.memory import memory_per_gpu
    from orangetron.plan.overhead import DEFAULT_OVERHEAD, with_overhead

    model, cluster = load_model("llama3-70b"), make_cluster("h100", 64)
    space = SearchSpace(tp=(8,), pp=(2,), cp=(1,), virtual_stages=(1,), micro_batch=(1,), zero=("distopt",))
    best = search(model, cluster, seq_len=8192, global_batch=64, space=space, top=1).ranked[0]
    assert best.job.recompute == "full" and 0 < best.job.recompute_layers < 40

    def fits(job):
        return with_overhead(memory_per_gpu(model, best.degrees, job), best.degrees,
                             DEFAULT_OVERHEAD)["total"] <= cluster.gpu.memory_bytes

    assert not fits(replace(best.job, recompute="none", recompute_layers=0))
    fitting = [r for r in range(1, 40) if fits(replace(best.job, recompute_layers=r))]
    assert best.job.recompute_layers == min(fitting)
    full = estimate(model, best.degrees, replace(best.job, recompute_layers=0), cluster)
    assert best.time.step_s < full.time.step_s
    off = search(model, cluster, seq_len=8192, global_batch=64, space=replace(space, partial_recompute=False), top=1)
    assert off.ranked[0].job.recompute_layers == 0
