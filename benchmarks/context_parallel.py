"""Context parallelism: balance, scale, bytes per mode, and ring step time, measured in one run.

1. Balance: query-key pairs each cp rank's causal attention must compute (keys at or before the query),
   for the head-tail split and for a contiguous split, as max/min over ranks; and the pairs our ring
   attention actually handed the fused kernel per rank (counted by wrapping the kernel seam), max/min.
2. Scale: the longest sequence whose saved activations per rank (measured by the activation meter over a
   forward and backward of a small model, ring mode) fit a fixed budget, for cp = 1, 2, 4; ratio to cp=1.
3. Bytes: what each mode sends per rank for one attention layer, forward and backward (the ledger), for
   cp = 2, 4, 8 with the sequence grown with cp: Ulysses stays constant, the rings grow (the published
   comparison, docs/context_parallel.md). The baseline is the same mode at cp=2.
4. Time: ring attention (transfers overlapped with the block at hand) against the same ring waiting for
   each transfer (serial) and against all-gather, forward and backward of one attention layer; and each
   mode's fused block kernel against its matmul blocks ("reference").
   PyTorch's own `context_parallel` has no CPU kernel strategy (aten._scaled_dot_product_flash_attention_
   for_cpu has no sharding rule), so it is not compared here.
5. Packed documents: the embedded corpus's files (one document each, bytes are tokens) packed into 32,768
   tokens; visible query-key pairs per cp rank (earlier keys of the same document) under the balanced sharding
   packed rows take, the head-tail and a contiguous split, max/mean, at cp = 4 and 8; the pairs our ring
   attention handed the fused kernel at cp = 4, summed over ranks, against the visible pairs and the pairs of
   the same sequence as one document; the K,V bytes each rank receives in the ring's forward against the
   minimum (the keys of other ranks it sees, each once), the worst rank; and the bytes ring attention sends over
   all ranks, forward and backward, with and without the documents. `--packed` runs this part alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from orangetron import comm, memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.model.documents import Documents
from orangetron.parallel import ParallelConfig, context, parallelize
from orangetron.parallel.context import blocks, ring
from orangetron.parallel.context.sharding import head_tail_indices
from orangetron.spec.layout import Layout
from orangetron.spec.variants import CONTEXT_MODES
from orangetron.testing import run_distributed, shutdown_workers
from orangetron.train.corpus import stdlib_documents

SMALL = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=64, ffn_dim=64, max_seq_len=1 << 16)
BUDGET = 4 << 20  # bytes of saved activations per rank
HEADS, HEAD_DIM = 8, 16


def _line(name: str, config: dict, metric: str, value: float, unit: str, baseline: float) -> str:
    ratio = value / baseline if baseline else 0.0
    return json.dumps({"name": name, "config": config, "metric": metric, "value": round(value, 5), "unit": unit,
                       "baseline": round(baseline, 5), "ratio": round(ratio, 3)})


# ---- 1. balance -------------------------------------------------------------------------------------
def causal_pairs(positions: torch.Tensor, seq_len: int) -> int:
    return int(positions.add(1).sum())  # a query at position p sees p + 1 keys


def ring_pairs(seq_len: int, document_ids: torch.Tensor | None = None) -> int:
    """Query-key pairs this rank's ring attention computed: every call `blocks.attend` hands the kernel."""
    mesh = init_mesh(Layout(cp=mesh_size()))
    q = torch.randn(1, seq_len // mesh["cp"].size, 1, 4)
    documents = None if document_ids is None else Documents.from_ids(document_ids)
    pairs, kernel = [], blocks.attention_kernel

    def counted(q_block: torch.Tensor, k_block: torch.Tensor, *args, **kwargs):
        n = q_block.shape[1]  # a causal call computes the pairs on and below its diagonal
        pairs.append(n * (n + 1) // 2 if kwargs["causal"] else n * k_block.shape[1])
        return kernel(q_block, k_block, *args, **kwargs)

    blocks.attention_kernel = counted  # this worker's copy of the module, restored below
    try:
        ring.attention(q, q, q, mesh["cp"], causal=True, scale=0.5, documents=documents)
    finally:
        blocks.attention_kernel = kernel
    return sum(pairs)


def mesh_size() -> int:
    return torch.distributed.get_world_size()


def balance(cp: int, seq_len: int) -> None:
    chunk = seq_len // cp
    head_tail = [causal_pairs(head_tail_indices(seq_len, cp, r), seq_len) for r in range(cp)]
    contiguous = [causal_pairs(torch.arange(r * chunk, (r + 1) * chunk), seq_len) for r in range(cp)]
    computed = run_distributed(ring_pairs, cp, args=(seq_len,))
    config = {"cp": cp, "seq_len": seq_len}
    for name, per_rank in (("head_tail", head_tail), ("contiguous", contiguous), ("ring_computed", computed)):
        print(_line("cp_attention_balance", {**config, "split": name}, "max_over_min_pairs",
                    max(per_rank) / min(per_rank), "ratio", 1.0), flush=True)


# ---- 2. scale ---------------------------------------------------------------------------------------
def activation_peak(seq_len: int) -> int:
    mesh = init_mesh(Layout(cp=mesh_size()))
    dp = parallelize(Transformer(SMALL, seed=0), mesh, ParallelConfig(cp_mode="ring"))
    tokens = torch.randint(0, SMALL.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = context.position_ids(seq_len, mesh)
    inputs, labels = context.shard(inputs, mesh), context.shard(labels, mesh)
    with memory.track_activations(dp.module) as meter:
        dp.module.loss_from_logits(dp(inputs, position_ids=positions), labels).backward()
    return meter.peak_bytes


def longest_sequence(cp: int) -> int:
    step = 2 * cp * 64
    fits, too_long = step, None
    while too_long is None:  # double until the budget breaks, then bisect in whole steps
        trial = fits * 2
        if max(run_distributed(activation_peak, cp, args=(trial,))) <= BUDGET:
            fits = trial
        else:
            too_long = trial
    while too_long - fits > step:
        middle = (fits + too_long) // 2 // step * step
        if max(run_distributed(activation_peak, cp, args=(middle,))) <= BUDGET:
            fits = middle
        else:
            too_long = middle
    return fits


# ---- 3. bytes and 4. time ---------------------------------------------------------------------------
def attention_layer(mode: str, seq_len: int, repeats: int = 1, overlap: bool = True,
                    impl: str = "fused") -> tuple[int, float]:
    """Bytes this rank sent for one attention forward and backward, and the median seconds of `repeats`."""
    mesh = init_mesh(Layout(cp=mesh_size()))
    g = torch.Generator().manual_seed(0)
    shape = (1, seq_len // mesh["cp"].size, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    times, sent = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        with comm.measure() as records:
            if mode == "ring":
                out = ring.attention(q, k, v, mesh["cp"], True, HEAD_DIM**-0.5, impl, overlap=overlap)[0]
            else:
                out = context.attention(q, k, v, mesh, mode=mode, impl=impl)
            out.sum().backward()
        times.append(time.perf_counter() - start)
        sent = sum(r.bytes_sent for r in records)
    return sent, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packed", action="store_true", help="the packed-documents balance and bytes only")
    if parser.parse_args().packed:
        packed_balance()
        shutdown_workers()
        return
    balance(4, 4096)
    base = longest_sequence(1)
    for cp in (1, 2, 4):
        longest = base if cp == 1 else longest_sequence(cp)
        print(_line("cp_longest_sequence", {"cp": cp, "mode": "ring", "budget_bytes": BUDGET, "model": "dim 32"},
                    "seq_len", longest, "tokens", base), flush=True)
    for mode in CONTEXT_MODES.names(runtime=True):
        at_two = None
        for cp in (2, 4, 8):
            sent = max(s for s, _ in run_distributed(attention_layer, cp, args=(mode, 256 * cp)))
            at_two = at_two or sent
            config = {"mode": mode, "cp": cp, "seq_len": 256 * cp, "heads": HEADS, "head_dim": HEAD_DIM,
                      "baseline": "same mode at cp=2"}
            print(_line("cp_bytes_sent_per_rank", config, "bytes", sent, "B", at_two), flush=True)
    seq = 4096
    timed = {name: max(t for _, t in run_distributed(attention_layer, 2, args=(mode, seq, 5, overlap)))
             for name, mode, overlap in (("ring", "ring", True), ("serial_ring", "ring", False),
                                         ("allgather", "allgather", True))}
    for against in ("serial_ring", "allgather"):
        config = {"cp": 2, "seq_len": seq, "heads": HEADS, "head_dim": HEAD_DIM, "baseline": against}
        print(_line("cp_ring_attention_step", config, "step_s", timed["ring"], "s", timed[against]), flush=True)
    fused_against_reference(seq)
    packed_balance()
    shutdown_workers()


# ---- 5. packed documents ----------------------------------------------------------------------------
def packed_document_ids(seq_len: int) -> torch.Tensor:
    """Document ids [1, seq_len] of the embedded corpus's files packed from its start (the last one cut)."""
    lengths, total = [], 0
    for text in stdlib_documents(seq_len):
        lengths.append(min(len(text.encode("utf-8")), seq_len - total))
        total += lengths[-1]
    lengths[-1] += seq_len - total  # a corpus shorter than the window: its last document fills it
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)


def document_pairs(positions: torch.Tensor, ids: torch.Tensor) -> int:
    """Visible pairs of the queries at `positions`: a query sees itself and the earlier keys of its document."""
    starts = Documents.from_ids(ids).positions()[0]  # offset of each position in its document
    return int(starts[positions].add(1).sum())


def packed_balance(seq_len: int = 32_768) -> None:
    ids = packed_document_ids(seq_len)
    lengths = torch.bincount(ids[0]).tolist()
    for cp in (4, 8):
        chunk = seq_len // cp
        cuts = Documents.from_ids(ids).cuts
        splits = {"balanced": [context.shard_indices(seq_len, cp, r, cuts) for r in range(cp)],
                  "head_tail": [head_tail_indices(seq_len, cp, r) for r in range(cp)],
                  "contiguous": [torch.arange(r * chunk, (r + 1) * chunk) for r in range(cp)]}
        for name, shards in splits.items():
            per_rank = [document_pairs(shard, ids) for shard in shards]
            config = {"cp": cp, "seq_len": seq_len, "documents": len(lengths), "longest": max(lengths),
                      "split": name}
            print(_line("cp_packed_balance", config, "max_over_mean_pairs",
                        max(per_rank) / statistics.mean(per_rank), "ratio", 1.0), flush=True)
    computed = sum(run_distributed(ring_pairs, 4, args=(seq_len, ids)))
    one_document = sum(run_distributed(ring_pairs, 4, args=(seq_len,)))
    config = {"cp": 4, "seq_len": seq_len, "documents": len(lengths), "mode": "ring",
              "baseline": "the same sequence as one document"}
    print(_line("cp_packed_kernel_pairs", config, "pairs", computed, "pairs", one_document), flush=True)
    visible = document_pairs(torch.arange(seq_len), ids)
    print(_line("cp_packed_kernel_pairs", {**config, "baseline": "visible pairs"}, "pairs", computed, "pairs",
                visible), flush=True)
    for cp in (4, 8):
        received = run_distributed(ring_received, cp, args=(seq_len, ids))
        minimum = [keys_seen_elsewhere(ids, cp, r) * 2 * 4 * 4 for r in range(cp)]  # K and V: 4 float32 each
        worst = max(range(cp), key=lambda r: received[r] / minimum[r])
        config = {"cp": cp, "seq_len": seq_len, "documents": len(lengths), "mode": "ring", "heads": 1,
                  "head_dim": 4, "rank": worst, "baseline": "the keys of other ranks it sees, each once"}
        print(_line("cp_packed_ring_bytes_received", config, "bytes", received[worst], "B", minimum[worst]),
              flush=True)
    for cp in (4, 8):
        packed = sum(run_distributed(ring_bytes, cp, args=(seq_len, ids)))
        whole = sum(run_distributed(ring_bytes, cp, args=(seq_len, None)))
        config = {"cp": cp, "seq_len": seq_len, "documents": len(lengths), "mode": "ring", "heads": 1,
                  "head_dim": 4, "baseline": "the same sequence as one document"}
        print(_line("cp_packed_ring_bytes", config, "bytes_sent_all_ranks", packed, "B", whole), flush=True)


def keys_seen_elsewhere(ids: torch.Tensor, cp: int, rank: int) -> int:
    """Keys held by other ranks (balanced sharding) that some query of `rank` sees: those of its documents up
    to its last query in each."""
    seq_len, row = ids.shape[1], ids[0]
    mine = context.shard_indices(seq_len, cp, rank, Documents.from_ids(ids).cuts)
    last = torch.full((int(row.max()) + 1,), -1).scatter_reduce(0, row[mine], mine, "amax")  # per document
    held = torch.zeros(seq_len, dtype=torch.bool)
    held[mine] = True
    return int(((torch.arange(seq_len) <= last[row]) & ~held).sum())


def ring_received(seq_len: int, document_ids: torch.Tensor) -> int:
    """Bytes this rank received through one ring attention forward (one head of 4, float32)."""
    mesh = init_mesh(Layout(cp=mesh_size()))
    q = torch.randn(1, seq_len // mesh["cp"].size, 1, 4)
    with comm.measure() as records:
        ring.attention(q, q, q, mesh["cp"], causal=True, scale=0.5, documents=Documents.from_ids(document_ids))
    return sum(r.bytes_received for r in records)


def ring_bytes(seq_len: int, document_ids: torch.Tensor | None) -> int:
    """Bytes this rank sent through one ring attention forward and backward (one head of 4, float32)."""
    mesh = init_mesh(Layout(cp=mesh_size()))
    q = torch.randn(1, seq_len // mesh["cp"].size, 1, 4, requires_grad=True)
    documents = None if document_ids is None else Documents.from_ids(document_ids)
    with comm.measure() as records:
        ring.attention(q, q, q, mesh["cp"], causal=True, scale=0.5, documents=documents)[0].sum().backward()
    return sum(r.bytes_sent for r in records)


def fused_against_reference(seq: int) -> None:
    """Each mode at cp=2 with the fused block kernel (torch's CPU flash op here) against its matmul blocks."""
    for mode in CONTEXT_MODES.names(runtime=True):
        if mode == "rsa":
            continue  # matmuls whatever the kernel: its kept probabilities are the method
        timed = {impl: max(t for _, t in run_distributed(attention_layer, 2, args=(mode, seq, 5, True, impl)))
                 for impl in ("fused", "reference")}
        config = {"mode": mode, "cp": 2, "seq_len": seq, "heads": HEADS, "head_dim": HEAD_DIM,
                  "baseline": "reference (matmul) blocks"}
        print(_line("cp_fused_block_kernel", config, "step_s", timed["fused"], "s", timed["reference"]), flush=True)


if __name__ == "__main__":
    main()
