"""Sharded checkpoints: every rank's boxes are exact, reshard onto any layout, are written once, and saving
holds about one shard per rank, not the model.

One launch of 4 ranks does all multi-rank checks: a state saved on each layout is loaded onto the next
(tp with replicated key/value heads, ZeRO-3, tp x dp x ep with ZeRO-1 and sequence parallelism, pp x dp with
ZeRO-2, cp x dp under DDP, bf16 with fp32 masters), and every rank's pieces are compared with the whole
tensors of the plain one-device model. Moments are set to elementwise functions of the parameters, so their
whole tensors are known from the plain model too.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from orangetron import comm, memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer, model_preset
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.parallel.state import flat_range_boxes
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers
from orangetron.train.checkpoint import load_checkpoint, load_into, open_checkpoint, save_checkpoint

torch.set_num_threads(1)
MOE = model_preset("tiny-moe")
LAYOUTS = [  # each is saved, then loaded onto the next (the last onto the first)
    (Layout(tp=4), dict(zero_stage=0)),
    (Layout(dp=4), dict(zero_stage=3)),
    (Layout(tp=2, dp=2, ep=2), dict(zero_stage=1, sequence_parallel=True)),
    (Layout(pp=2, dp=2), dict(zero_stage=2)),
    (Layout(dp=4), dict(zero_stage=2, grad_bucket_numel=500)),  # parameters cross buckets
    (Layout(tp=2, dp=2), dict(distributed_optimizer=True, grad_bucket_numel=300)),
    (Layout(cp=2, dp=2), dict(zero_stage=0)),
]
MIXED = [(Layout(dp=2, tp=2), dict(zero_stage=1)), (Layout(dp=4), dict(zero_stage=3))]  # bf16, fp32 masters
# Dense, ~1.1M parameters: large enough that tensor bytes, not bookkeeping, decide the peak while saving.
BIG = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=512, max_seq_len=64)


# ---- boxes of a flat range -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 1, 3, 2)])
def test_flat_range_boxes_tile_the_range_contiguously(shape):
    n = math.prod(shape)
    for start in range(n):
        for stop in range(start, n + 1):
            covered = torch.zeros(shape, dtype=torch.long)
            boxes = flat_range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            at = start
            for offsets, sizes, flat_start in boxes:
                region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                covered[region] += 1
                # contiguous in the flattened tensor, starting where the previous box ended
                first = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offsets))
                assert flat_start == first == at
                assert torch.arange(n).view(shape)[region].flatten().tolist() == list(range(at, at + math.prod(sizes)))
                at += math.prod(sizes)
            expected = torch.zeros(n, dtype=torch.long)
            expected[start:stop] = 1
            assert covered.flatten().tolist() == expected.tolist(), (shape, start, stop)


def test_hand_written_boxes_of_a_matrix_range():
    # elements 3..13 of a 3 x 5 matrix: the tail of row 0, row 1 whole, the head of row 2
    assert flat_range_boxes((3, 5), 3, 13) == [((0, 3), (1, 2), 3), ((1, 0), (1, 5), 5), ((2, 0), (1, 3), 10)]
    assert flat_range_boxes((3, 5), 5, 15) == [((1, 0), (2, 5), 5)]
    assert flat_range_boxes((3, 5), 6, 8) == [((1, 1), (1, 2), 6)]


# ---- the multi-rank checks, one launch ---------------------------------------------------------------------

def _reference(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """Whole tensors from the plain one-device model: params, moments as set by `_set_moments`, buffers."""
    model = Transformer(cfg, seed=0, dtype=dtype)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "exp_avg": {n: 2 * p + 1 for n, p in params.items()},
            "exp_avg_sq": {n: p * p for n, p in params.items()},
            "buffers": {n: _buffer_values(b) for n, b in model.named_buffers()}}


def _buffer_values(buffer: torch.Tensor) -> torch.Tensor:
    return torch.arange(buffer.numel(), dtype=buffer.dtype).view(buffer.shape) / 8 - 1


def _build(layout: Layout, options: dict, seed: int, dtype: str = "float64", cfg: ModelConfig = MOE):
    mesh = init_mesh(layout)
    model_dtype = torch.float64 if dtype == "float64" else torch.float32
    pc = ParallelConfig(param_dtype=dtype, **options)
    dp = parallelize(Transformer(cfg, seed=seed, dtype=model_dtype), mesh, pc)
    return dp, dp.optimizer(lr=1e-3)


def _set_moments(dp, opt) -> None:
    """Moments as elementwise functions of the main parameters (so sharding cannot change them), buffers
    as known values."""
    with torch.no_grad():
        for part, adamw in zip(dp.parts, opt.adamws, strict=True):
            adamw.exp_avg.copy_(2 * part.main_params + 1)
            adamw.exp_avg_sq.copy_(part.main_params * part.main_params)
        for _, b in dp.module.named_buffers():
            b.copy_(_buffer_values(b))
    for adamw in opt.adamws:
        adamw.steps = 7


def _mismatches(dp, opt, reference: dict) -> list[str]:
    """Every piece this rank holds against the reference's box; the model's parameters (its tp/ep slices,
    where this rank keeps them whole) against the main parameters; the step count."""
    bad = []
    for key, tensors in dp.sharded_state(opt).items():
        for name, shards in tensors.items():
            whole = reference[key][name]
            if tuple(whole.shape) != shards.shape:
                bad.append(f"{key} {name}: shape {shards.shape} != {tuple(whole.shape)}")
            for piece in shards.pieces:
                box = whole[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))]
                if not torch.equal(piece.data, box.to(piece.data.dtype)):
                    bad.append(f"{key} {name} at {piece.offsets}")
    if not dp.zero3:
        for part in dp.parts:
            if not torch.equal(part.param_shard, part.main_params.to(part.param_shard.dtype)):
                bad.append("model-dtype parameters differ from the main parameters")
            full = part.owned_view(part.flat_params)  # a [buckets, slice] view when bucketed
            if not torch.equal(full, part.param_shard):
                bad.append("the full flat parameters were not gathered after loading")
    if any(adamw.steps != 7 for adamw in opt.adamws):
        bad.append("AdamW step count")
    return bad


def _save(dp, opt, folder: Path) -> None:
    save_checkpoint(folder, 1, dp.sharded_state(opt), comm.world_group())


def _load(dp, opt, folder: Path) -> None:
    checkpoint = open_checkpoint(folder / "step-00000001", comm.world_group())
    state = dp.sharded_state(opt)
    load_into(checkpoint, state, comm.world_group())
    dp.state_loaded(opt, 7)


def _reshard_cycle(folder: Path, layouts: list, dtype: str, reference: dict) -> dict[str, list[str]]:
    out = {}
    for i, (layout, options) in enumerate(layouts):
        dp, opt = _build(layout, options, seed=0, dtype=dtype)
        _set_moments(dp, opt)
        out[f"saved on {layout}"] = _mismatches(dp, opt, reference)  # the reference itself is right
        _save(dp, opt, folder / f"{dtype}-{i}")
        target, target_options = layouts[(i + 1) % len(layouts)]
        dp, opt = _build(target, target_options, seed=1, dtype=dtype)  # other weights: loading must replace all
        _load(dp, opt, folder / f"{dtype}-{i}")
        out[f"{layout} -> {target}"] = _mismatches(dp, opt, reference)
    return out


def _saving_peaks(folder: Path) -> dict[str, int]:
    """dp=4 ZeRO-3: peak bytes while saving a sharded checkpoint, and while gathering the whole state."""
    dp, opt = _build(Layout(dp=4), dict(zero_stage=3), seed=0, cfg=BIG)
    with memory.peak_allocations() as sharded:
        _save(dp, opt, folder / "big")
    with comm.unmeasured(), memory.peak_allocations() as gathered:
        dp.full_state(opt)
    return {"sharded": sharded.total, "sharded_torch": sharded.torch_bytes, "gathered": gathered.total}


_COLLECTIVES = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object", "gather",
                "gather_object", "scatter", "scatter_object_list", "broadcast", "broadcast_object_list", "all_reduce",
                "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
                "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")


@contextlib.contextmanager
def _counting_collectives():
    """Count every torch.distributed collective called inside the block (whoever calls it)."""
    import torch.distributed as dist

    calls, originals = [], {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _checkpoint_traffic(folder: Path) -> dict[str, tuple[int, int]]:
    """(torch.distributed calls, ledger records) of saving and of loading a sharded checkpoint."""
    dp, opt = _build(Layout(tp=2, dp=2), dict(zero_stage=1), seed=0)
    out = {}
    with _counting_collectives() as calls, comm.measure() as records:
        _save(dp, opt, folder / "ledger")
    out["save"] = (len(calls), len(records))
    with _counting_collectives() as calls, comm.measure() as records:
        _load(dp, opt, folder / "ledger")
    out["load"] = (len(calls), len(records))
    return out


def _all_checks(folder: str) -> dict:
    folder = Path(folder)
    out = {"traffic": _checkpoint_traffic(folder)}
    out["float64"] = _reshard_cycle(folder, LAYOUTS, "float64", _reference(MOE, torch.float64))
    mixed = _reference(MOE, torch.float32)
    mixed = {k: {n: t.to(torch.bfloat16).to(torch.float32) if k != "buffers" else t for n, t in v.items()}
             for k, v in mixed.items()}
    mixed["exp_avg"] = {n: 2 * p + 1 for n, p in mixed["params"].items()}
    mixed["exp_avg_sq"] = {n: p * p for n, p in mixed["params"].items()}
    out["bf16"] = _reshard_cycle(folder, MIXED, "bfloat16", mixed)
    out["peaks"] = _saving_peaks(folder)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("sharded")
    results = run_distributed(_all_checks, 4, args=(str(folder),), timeout=600)  # many layouts in one call
    shutdown_workers(4)  # its peak measurement leaves Python's allocation tracing on (memory.peak_allocations)
    return folder, results


def test_checkpoint_traffic_goes_through_the_ledger(four_ranks):
    """Every torch.distributed call made while saving and loading is one of comm's recorded collectives (none
    is DCP's own): saving exchanges six times (name, plans, write results, metadata written, manifest,
    done), loading twice (files checked, boxes read), each a recorded pair of all-gathers; after loading,
    ZeRO-1 all-gathers its parameters once."""
    _, results = four_ranks
    for result in results:
        assert result["traffic"] == {"save": (12, 12), "load": (5, 5)}


def test_every_layout_reshards_onto_the_next_exactly(four_ranks):
    _, results = four_ranks
    for rank, result in enumerate(results):
        for dtype in ("float64", "bf16"):
            for case, bad in result[dtype].items():
                assert bad == [], f"rank {rank}, {dtype}, {case}: {bad[:3]}"


def test_the_consolidated_checkpoint_is_the_one_device_model(four_ranks):
    folder, _ = four_ranks
    reference = _reference(MOE, torch.float64)
    for i in range(len(LAYOUTS)):
        state = load_checkpoint(folder / f"float64-{i}" / "step-00000001")
        for key in ("params", "exp_avg", "exp_avg_sq", "buffers"):
            assert state.get(key, {}).keys() == reference[key].keys(), (i, key)
            for name, whole in reference[key].items():
                assert torch.equal(state[key][name], whole), (i, key, name)


def test_replicas_are_written_once(four_ranks):
    """DDP (tp=4 with replicated weights, and cp x dp): each element of each tensor is stored exactly once, and
    the tensor bytes of all files together are one copy of the state."""
    folder, _ = four_ranks
    for i in (0, 4):
        checkpoint = open_checkpoint(folder / f"float64-{i}" / "step-00000001")
        for name, md in checkpoint.metadata.state_dict_metadata.items():
            assert sum(math.prod(c.sizes) for c in md.chunks) == math.prod(md.size), name
        state_numel = 3 * sum(p.numel() for p in Transformer(MOE, seed=0).parameters())
        stored = sum(f.stat().st_size for f in (folder / f"float64-{i}" / "step-00000001").glob("*.distcp"))
        per_item = 2048  # torch.save's own framing around each box
        assert state_numel * 8 <= stored <= state_numel * 8 + per_item * len(checkpoint.metadata.storage_data)


def test_saving_holds_about_one_shard_per_rank_not_the_model(four_ranks):
    """dp=4 ZeRO-3: the whole state (main params and two moments, float64) is S bytes; a rank's shard S/4.
    Saving must stay under S/2 on every rank (the copy DCP makes of each box before writing it, plus
    bookkeeping), while gathering the whole state, measured the same way, takes more than S."""
    _, results = four_ranks
    whole = 3 * 8 * sum(p.numel() for p in Transformer(BIG, seed=0).parameters())
    for rank, result in enumerate(results):
        peaks = result["peaks"]
        assert peaks["gathered"] > whole, (rank, peaks, whole)  # the instrument sees a gather
        assert peaks["sharded"] < whole / 2, (rank, peaks, whole)
        assert peaks["sharded_torch"] <= whole / 4 * 1.25, (rank, peaks, whole)  # about one shard



def _shared_outcomes() -> tuple[object, object]:
    from orangetron.train.sharded import CheckpointError, _everywhere

    group = comm.world_group()
    ok = _everywhere(lambda: group.rank * 10, group)

    def fail_on_rank_one() -> int:
        if group.rank == 1:
            raise CheckpointError("rank 1 could not write its shard")
        return group.rank

    try:
        _everywhere(fail_on_rank_one, group)
        failed: object = "returned"
    except CheckpointError as err:
        failed = str(err)
    return ok, failed


def test_a_checkpoint_step_that_fails_on_one_rank_raises_on_every_rank():
    """Saving and loading share each step's outcome: results in rank order, or the failing rank's error on all
    ranks (a rank that went on alone would wait forever at its next collective)."""
    assert run_distributed(_shared_outcomes, 2) == [([0, 10], "rank 1 could not write its shard")] * 2
