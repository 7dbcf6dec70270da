"""The planner prices attention over packed documents (`estimate --doc-lengths FILE`): the busiest cp rank's
visible keys under the balanced sharding, counted here token by token in plain torch, and the K,V its ring
receives, against the ledger of a real ring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orangetron import cli
from orangetron.parallel.context.sharding import shard_indices
from orangetron.plan.compute import ATTN_BLOCK, causal_keys
from orangetron.plan.packed import batches, document_keys, windows


def packed_rows(lengths: list[int], seq: int, rows: int, padding: int = 0) -> list[torch.Tensor]:
    """Document ids [rows, seq + padding] of each micro-batch of `rows` consecutive whole sequences the documents
    fill (lengths repeated until they fill one micro-batch; a short last one left out), each row then padded by
    `padding` tokens of a document of their own, packed here by plain torch."""
    copies = max(1, -(-rows * seq // sum(lengths)))
    stream = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths * copies)])
    sequences = stream[:stream.numel() // seq * seq].view(-1, seq)
    sequences = torch.nn.functional.pad(sequences, (0, padding), value=len(lengths) * copies)
    return [sequences[i:i + rows] for i in range(0, sequences.shape[0] - rows + 1, rows)]


def brute_keys(lengths: list[int], seq: int, cp: int, rows: int = 1, padding: int = 0) -> float:
    """Per micro-batch, each query's keys: itself and the earlier tokens of its document in its row, plus half its
    piece's diagonal block less one (a block is computed whole); the rows sharded together, cut at every row's
    document starts (the runtime's `shard_indices`); the busiest rank's mean per query and row, averaged over
    the micro-batches."""
    busiest = []
    seq += padding
    for batch in packed_rows(lengths, seq - padding, rows, padding):
        keys = torch.zeros(batch.shape, dtype=torch.float64)
        for r, ids in enumerate(batch):
            for d in ids.unique():
                where = (ids == d).nonzero().flatten()
                n = where.numel()
                keys[r, where] = torch.arange(1, n + 1, dtype=torch.float64) + (min(n, ATTN_BLOCK) - 1) / 2
        starts = torch.diff(batch, dim=1, prepend=batch[:, :1] - 1) != 0
        cuts = tuple(int(i) for i in torch.nonzero(starts.any(dim=0)).flatten())
        ranks = [shard_indices(seq, cp, r, cuts) for r in range(cp)] if cp > 1 else [torch.arange(seq)]
        busiest.append(max(float(keys[:, r].sum()) for r in ranks) / rows)
    return sum(busiest) / len(busiest) / (seq // cp)


@pytest.mark.parametrize("cp", (1, 2, 4))
@pytest.mark.parametrize("lengths", [[1, 300, 17, 2000, 5, 700], [4096], [100] * 7, [3000, 40, 40, 200]])
def test_document_keys_are_the_busiest_ranks_visible_keys(cp, lengths):
    assert document_keys(batches(tuple(lengths), 1024, 1), 1024, cp) == \
        pytest.approx(brute_keys(lengths, 1024, cp), rel=1e-12)


@pytest.mark.parametrize("rows", (2, 3))
def test_a_micro_batchs_rows_are_sharded_together_at_all_their_boundaries(rows):
    """Rows with other boundaries are cut at every row's document starts, as the runtime shards a micro-batch:
    the busiest rank's keys are those of all its rows under that sharding."""
    lengths = [1, 300, 17, 2000, 5, 700, 90, 90]
    for cp in (2, 4):
        priced = batches(tuple(lengths), 1024, rows)
        assert [batch for batch, _ in priced][0] == tuple(windows(tuple(lengths), 1024)[i][0] for i in range(rows))
        assert document_keys(priced, 1024, cp) == pytest.approx(brute_keys(lengths, 1024, cp, rows), rel=1e-12)


@pytest.mark.parametrize("rows", (1, 2))
def test_a_padded_sequence_packs_its_data_and_ends_with_its_padding_as_a_document(rows):
    """Under cp a sequence the ranks cannot split runs padded, and its padding is a document of its own: the
    documents pack into the data's 30 tokens, not the 32 the sequence runs at (which priced 10% more keys on
    the busiest rank), and every rank's keys and ring are those of the padded rows."""
    from orangetron.plan.packed import priced_batches
    from orangetron.spec.options import Job

    lengths = [4, 8, 12, 16, 20, 24, 28, 32, 21]
    job = Job(seq_len=32, data_seq_len=30, micro_batch=rows, doc_lengths=lengths)
    priced = priced_batches(job)
    assert all(row[-1] == (30, 32) for batch, _ in priced for row in batch)
    assert document_keys(priced, 32, 2) == pytest.approx(brute_keys(lengths, 30, 2, rows, padding=2), rel=1e-12)


def test_one_document_per_sequence_is_the_causal_price_and_the_balanced_sharding_keeps_its_balance():
    for cp in (1, 4):
        assert document_keys(batches((4096,), 4096, 1), 4096, cp) == causal_keys(4096)
    # A long document at the end (head-tail over the row would give its tail chunks most of it): every document
    # a multiple of 2*cp tokens, so every rank does exactly 1/cp of the work.
    priced = batches((256,) * 8 + (2048,), 4096, 1)
    assert document_keys(priced, 4096, 4) == pytest.approx(document_keys(priced, 4096, 1), rel=1e-12)


def test_estimate_prices_packed_documents_from_a_file(tmp_path, capsys):
    flags = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "4", "--cp", "2", "--seq", "4096", "--json"]
    assert cli.main(flags) == 0
    whole = json.loads(capsys.readouterr().out)
    (tmp_path / "lengths.txt").write_text("512 7\n64 8\n")
    assert cli.main([*flags, "--doc-lengths", str(tmp_path / "lengths.txt")]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert packed["time_breakdown_s"]["compute_s"] < whole["time_breakdown_s"]["compute_s"]
    # The packed ring leaves runs home that no later rank sees: fewer bytes on the wire.
    assert packed["time_breakdown_s"]["cp_s"] < whole["time_breakdown_s"]["cp_s"]
    (tmp_path / "bad.txt").write_text("512\n0\n")
    with pytest.raises(SystemExit):
        cli.main([*flags, "--doc-lengths", str(tmp_path / "bad.txt")])
    assert "bad.txt:2: expected LENGTH or LENGTH COUNT" in capsys.readouterr().err
    (tmp_path / "many.txt").write_text("512 7\n64 100000000\n")  # it built a list of 10^8 lengths, then more
    with pytest.raises(SystemExit):
        cli.main([*flags, "--doc-lengths", str(tmp_path / "many.txt")])
    assert "many.txt:2: more than 1,000,000 documents; give a sample" in capsys.readouterr().err


def test_a_document_of_any_length_costs_the_same_to_price():
    """Each whole sequence of a long document was listed one by one: 10^20 tokens ran out of memory. Every
    sequence of one document alone is its causal sequence, whatever the document's length."""
    assert document_keys(batches((10**20,), 4096, 1), 4096, 4) == causal_keys(4096)
    assert windows((10**20,), 4096) == [(((0, 4096),), 10**20 // 4096)]
    assert batches((1, 10**20), 4096, 3).batches == (((((0, 1), (1, 4096)), ((0, 4096),), ((0, 4096),)), 1),
                                             ((((0, 4096),),) * 3, ((10**20 + 1) // 4096 - 3) // 3))
    # after a short one too: the shortcut held only for a document that began a sequence
    assert windows((1, 10**20), 4096) == [(((0, 1), (1, 4096)), 1), (((0, 4096),), (10**20 + 1) // 4096 - 1)]


def ring_ledger(ids: torch.Tensor) -> tuple[int, int]:
    """Bytes this rank received in one ring attention's forward and in its backward, over rows of packed
    documents `ids` [rows, seq] (two query heads, one kv head of 4, float32)."""
    from orangetron import comm
    from orangetron.mesh import init_mesh
    from orangetron.model.documents import Documents
    from orangetron.parallel import context
    from orangetron.spec.layout import Layout

    documents = Documents.from_ids(ids)
    mesh = init_mesh(Layout(cp=torch.distributed.get_world_size()))
    q, k, v = (torch.randn(ids.shape[0], ids.shape[1], h, 4) for h in (2, 1, 1))
    q, k, v = (context.shard(t, mesh, cuts=documents.cuts).requires_grad_() for t in (q, k, v))
    with comm.measure() as forward:
        out = context.attention(q, k, v, mesh, mode="ring", documents=documents)
    with comm.measure() as backward:
        out.sum().backward()
    return sum(r.bytes_received for r in forward), sum(r.bytes_received for r in backward)


@pytest.mark.parametrize("cp", (2, 3))
def test_ring_traffic_over_packed_documents_is_the_ledgers(cp):
    """Documents one token long, shorter than 2*cp (some ranks hold none of them, so a run passes through members
    that do not see it), and long: each rank's forward K,V bytes are the planner's tokens for it, and the busiest
    rank's forward and backward are the planner's cp records (the dK,dV accumulators whole, cp hops). Two rows
    with other boundaries, sharded together at all of them, receive more than either row alone would."""
    from orangetron.plan.packed import Priced, ring_received_tokens
    from orangetron.plan.traffic import context_parallel_records
    from orangetron.spec.model import ModelSpec
    from orangetron.spec.options import Degrees, Job
    from orangetron.testing import run_distributed

    lengths = (1, cp + 1, 9 * cp + 1, 1, 2, 14 * cp - 6, 5, 2 * cp)
    seq = sum(lengths[:6])
    assert seq % (2 * cp) == 0
    model = ModelSpec(name="tiny", hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=16,
                      ffn_hidden_size=16)
    token_bytes = 2 * 4 * 4  # K and V of one kv head of 4, float32
    alone = []
    for rows in (1, 2):
        ids = packed_rows(list(lengths), seq, rows)[0]
        per_rank = run_distributed(ring_ledger, cp, args=(ids,))
        first = batches(lengths, seq, rows).batches[0]
        tokens = ring_received_tokens(Priced((first,)), seq, cp)
        assert [forward for forward, _ in per_rank] == [round(t * rows * token_bytes) for t in tokens], rows
        assert len(set(tokens)) > 1 and min(tokens) < (cp - 1) * seq / cp  # ranks differ; some keys stay home
        job = Job(seq_len=seq, global_batch=rows, micro_batch=rows, param_dtype="float32",
                  doc_batches=(first[0],))
        planned = sum(r.bytes_received for r in context_parallel_records(model, Degrees(cp=cp), job))
        assert planned == max(forward + backward for forward, backward in per_rank), rows
        alone.append(max(tokens))
    assert alone[1] > alone[0]  # the second row's boundaries cut the first's runs: more of them travel


def ring_records_of_micro_batches(micro_batches: list[torch.Tensor]) -> list[tuple]:
    """Every record this rank's ring attention issued, forward and backward, over each micro-batch of packed
    document ids [rows, seq] in turn (two query heads, one kv head of 4, float32)."""
    from orangetron import comm
    from orangetron.mesh import init_mesh
    from orangetron.model.documents import Documents
    from orangetron.parallel import context
    from orangetron.spec.layout import Layout

    mesh = init_mesh(Layout(cp=torch.distributed.get_world_size()))
    with comm.measure() as records:
        for ids in micro_batches:
            documents = Documents.from_ids(ids)
            q, k, v = (torch.randn(ids.shape[0], ids.shape[1], h, 4) for h in (2, 1, 1))
            q, k, v = (context.shard(t, mesh, cuts=documents.cuts).requires_grad_() for t in (q, k, v))
            context.attention(q, k, v, mesh, mode="ring", documents=documents).sum().backward()
    return sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records)


def test_each_micro_batch_of_a_step_rings_its_own_documents_record_for_record():
    """A step whose micro-batches hold other documents (`Job.doc_batches`, as a run's closing table prices its
    last step): each micro-batch's ring transfers are its own, record for record on every rank, not their mean
    times the micro-batches."""
    from orangetron.plan.traffic import step_records
    from orangetron.spec.model import ModelSpec
    from orangetron.spec.options import Degrees, Job
    from orangetron.testing import run_distributed

    cp, lengths = 3, (1, 4, 28, 1, 2, 36, 5, 6)
    seq = 72
    ids = packed_rows(list(lengths), seq, 2)[0]
    per_rank = run_distributed(ring_records_of_micro_batches, cp, args=([ids[:1], ids[1:]],))
    first, second = batches(lengths, seq, 2).batches[0][0]
    assert first != second
    model = ModelSpec(name="tiny", hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=16,
                      ffn_hidden_size=16)
    job = Job(seq_len=seq, microbatches=2, param_dtype="float32", doc_batches=((first,), (second,)))
    for rank, got in enumerate(per_rank):
        want = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received)
                      for r in step_records(model, Degrees(cp=cp), job, cp_rank=rank) if r.dim == "cp")
        assert got == want, rank


def test_model_flops_count_each_documents_own_attention_so_mfu_stays_below_the_peak(tmp_path, capsys):
    """The step time prices only a document's own keys, so model FLOPs must too: counting s x s over 2,048-token
    documents in 131,072-token sequences read MFU 185.6% and 1,836 TFLOP/s per GPU on an H100 (peak 989)."""
    from orangetron.plan.timing import model_flops_per_step
    from orangetron.spec.model import load_model
    from orangetron.spec.options import Job

    model = load_model("llama3-8b")
    # By hand: pieces of 1024, 512 and 512 tokens fill a 2,048-token sequence; a token sees its whole piece,
    # (1024^2 + 2 x 512^2) / 2048 = 768 keys on average: per token, the FLOPs of 768-token sequences.
    packed = model_flops_per_step(model, Job(seq_len=2048, doc_lengths=(1024, 512, 512)), 3) / (3 * 2048)
    assert packed == pytest.approx(model_flops_per_step(model, Job(seq_len=768), 5) / (5 * 768), rel=1e-12)
    causal = model_flops_per_step(model, Job(seq_len=2048, doc_lengths=(1024, 512, 512)), 3, causal_attention=True)
    half = model_flops_per_step(model, Job(seq_len=768), 5, causal_attention=True) / (5 * 768)  # 384 keys
    assert causal / (3 * 2048) == pytest.approx(half, rel=1e-12) and half < packed
    (tmp_path / "short.txt").write_text("2048 64\n")
    assert cli.main(["estimate", "--model", "llama3-8b", "--gpus", "16", "--tp", "2", "--cp", "8", "--seq", "131072",
                     "--global-batch", "1", "--sequence-parallel", "--zero-stage", "3", "--doc-lengths",
                     str(tmp_path / "short.txt"), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert 0 < priced["mfu_causal"] < priced["mfu"] <= priced["hfu"] < 1
    assert priced["tflops_per_gpu"] < 989.4


def test_a_micro_batchs_named_documents_must_cover_its_rows_and_name_every_micro_batch():
    """`Job.doc_batches` prices a run's own step: a row with a gap, an overlap, an empty document or a short end
    would price other documents than the run's, and a step's micro-batches each need theirs."""
    from orangetron.plan.traffic import step_records
    from orangetron.spec.model import ModelSpec
    from orangetron.spec.options import Degrees, Job

    Job(seq_len=8, doc_batches=((((0, 3), (3, 8)),),))
    for row in (((0, 3), (4, 8)), ((0, 4), (3, 8)), ((0, 3), (3, 7)), ((1, 8),), ((0, 0), (0, 8))):
        with pytest.raises(ValueError, match=r"must cover \[0, seq_len=8\)"):
            Job(seq_len=8, doc_batches=((row,),))
    with pytest.raises(ValueError, match="a micro-batch holds at least one row"):
        Job(seq_len=8, doc_batches=((),))
    model = ModelSpec(name="tiny", hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=16,
                      ffn_hidden_size=16)
    job = Job(seq_len=8, microbatches=2, param_dtype="float32", doc_batches=((((0, 8),),),))
    with pytest.raises(ValueError, match="doc_batches names 1 micro-batches; the step runs 2"):
        step_records(model, Degrees(cp=2), job)


def test_document_lengths_must_be_positive_integers():
    from orangetron.spec.options import Job

    assert Job(seq_len=8, doc_lengths=[3, 5]).doc_lengths == (3, 5)
    for lengths in ((3, 0), (3, True), (3, 2.0), (-1,)):
        with pytest.raises(ValueError, match="document lengths must be integers >= 1"):
            Job(seq_len=8, doc_lengths=lengths)


def test_plan_ranks_on_the_documents_it_is_given(tmp_path, capsys):
    """`plan --doc-lengths` prices every row on those documents: each row is what `estimate` gives its layout
    and job over them, and short documents make the fastest row faster than one document per sequence."""
    from dataclasses import replace

    from orangetron.plan.estimate import estimate
    from orangetron.spec.hardware import make_cluster
    from orangetron.spec.model import load_decoder
    from orangetron.spec.options import Degrees, Job

    (tmp_path / "lengths.txt").write_text("512 7\n64 8\n3000 1\n")
    lengths = (512,) * 7 + (64,) * 8 + (3000,)
    flags = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--cp", "2,4", "--top", "3", "--json"]
    assert cli.main(flags) == 0
    whole = json.loads(capsys.readouterr().out.splitlines()[-1])["ranked"]
    assert cli.main([*flags, "--doc-lengths", str(tmp_path / "lengths.txt")]) == 0
    packed = json.loads(capsys.readouterr().out.splitlines()[-1])["ranked"]
    assert packed[0]["step_time_s"] < 0.9 * whole[0]["step_time_s"]
    for row in packed:
        deg = Degrees(**{k: row["layout"][k] for k in ("tp", "cp", "pp", "dp", "ep")})
        job = replace(Job.from_json(row["job"]), doc_lengths=lengths)
        alone = estimate(load_decoder("llama3-8b"), deg, job, make_cluster("h100", 8))
        assert row["step_time_s"] == alone.time.step_s
        assert row["comm"] == alone.to_json()["comm"]
    # An emitted file names no data: it leaves packing to the run's, and says so
    emit = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "1024", "--emit-config", str(tmp_path / "run.toml")]
    assert cli.main([*emit, "--doc-lengths", str(tmp_path / "lengths.txt")]) == 0
    assert "the file leaves packing to the run's data" in capsys.readouterr().err
    assert "pack_documents" not in (tmp_path / "run.toml").read_text()


def _packed_run_file(tmp_path, texts: list[str], **options) -> str:
    """A run's config file (as `train --config` reads one) training `tiny` at cp 2 on these text files."""
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"doc{i:02}.txt")
        paths[-1].write_text(text)
    lines = ['model = "tiny"', "cp = 2", "seq_len = 30", "batch_size = 2", "eval_fraction = 0.25",
             f"data = [{', '.join(json.dumps(str(p)) for p in paths)}]",
             *(f"{key} = {json.dumps(value)}" for key, value in options.items())]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "run.toml")


def _estimate_json(capsys, *flags: str) -> tuple[dict, str]:
    assert cli.main(["estimate", "--gpu", "h100", "--json", *flags]) == 0
    out, err = capsys.readouterr()
    return json.loads(out.splitlines()[-1]), err


def test_estimate_of_a_run_that_packs_documents_prices_its_documents(tmp_path, capsys):
    """`estimate --config` of a run packing text files prices the training split's documents as `train` packs
    them: one a file, its bytes and the three-byte separator after it, the last quarter of the stream held
    out. The same prices as `--doc-lengths` with those lengths written by hand."""
    texts = ["a" * n for n in range(1, 38, 4)]  # with their separators 220 tokens, of which 55 held out
    config = _packed_run_file(tmp_path, texts, pack_documents=True)
    by_run, note = _estimate_json(capsys, "--config", config)
    assert "priced on the 9 training documents of the run's text files (4 to 32 tokens)" in note
    (tmp_path / "lengths.txt").write_text("4 8 12 16 20 24 28 32 21".replace(" ", "\n"))  # 144 + 21 of 36: 165
    by_hand, _ = _estimate_json(capsys, "--config", config, "--doc-lengths", str(tmp_path / "lengths.txt"))
    assert by_run == by_hand
    unpacked, note = _estimate_json(capsys, "--config", _packed_run_file(tmp_path, texts, pack_documents=False))
    assert "packs documents" not in note
    assert unpacked["comm"]["send_recv/cp"]["sent"] > by_run["comm"]["send_recv/cp"]["sent"]


def test_estimate_of_a_run_on_a_prepared_dataset_prices_its_documents(tmp_path, capsys):
    """A prepared dataset packs by default: `estimate --config` prices its training split's documents, each
    its tokens and the separator after it (three bytes for the byte tokenizer)."""
    texts = ["b" * n for n in range(2, 60, 3)]  # 20 documents, 670 tokens with separators: 167 held out
    config = _packed_run_file(tmp_path, texts)
    files = [str(tmp_path / f"doc{i:02}.txt") for i in range(len(texts))]
    assert cli.main(["prepare-data", "--quiet", "-o", str(tmp_path / "ds"), *files]) == 0
    text = Path(config).read_text().replace(f"data = [{', '.join(json.dumps(f) for f in files)}]",
                                            f"data = [{json.dumps(str(tmp_path / 'ds'))}]")
    Path(config).write_text(text)
    capsys.readouterr()
    by_run, note = _estimate_json(capsys, "--config", config)
    assert f"priced on the 18 training documents of the prepared dataset {tmp_path / 'ds'} (5 to 53 tokens)" in note
    lengths = [n + 3 for n in range(2, 51, 3)] + [10]  # 17 whole (493 tokens), then 10 of the 18th: 503
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)))
    by_hand, _ = _estimate_json(capsys, "--config", config, "--doc-lengths", str(tmp_path / "lengths.txt"))
    assert by_run == by_hand


def test_estimate_of_a_run_reads_its_documents_as_train_settles_them(tmp_path, capsys):
    """Dashed keys as `train --config` takes them; a Hugging Face folder without a tokenizer trains on bytes,
    and packs text files (one with a tokenizer.json does not: `train` refuses it); data this machine does not
    hold is priced one document per sequence, said."""
    import hf_models

    texts = ["a" * n for n in range(1, 38, 4)]
    config = _packed_run_file(tmp_path, texts, pack_documents=True)
    by_run, _ = _estimate_json(capsys, "--config", config)
    dashed = Path(config).read_text().replace("pack_documents", "pack-documents").replace("seq_len", "seq-len")
    Path(config).write_text(dashed.replace("batch_size", "batch-size").replace("eval_fraction", "eval-fraction"))
    assert _estimate_json(capsys, "--config", config)[0] == by_run

    folder = hf_models.llama(tmp_path / "hf")
    text = Path(config).read_text().replace('model = "tiny"', f"hf_model = {json.dumps(str(folder))}")
    Path(config).write_text(text)
    _, note = _estimate_json(capsys, "--config", config)
    assert "priced on the 9 training documents of the run's text files" in note
    hf_models.add_tokenizer(folder)
    assert "packs documents" not in _estimate_json(capsys, "--config", config)[1]

    missing = _packed_run_file(tmp_path, texts, pack_documents=True).replace("run.toml", "gone.toml")
    Path(missing).write_text(Path(tmp_path / "run.toml").read_text().replace("doc00.txt", "gone.txt"))
    priced, note = _estimate_json(capsys, "--config", missing)
    assert f"the run packs documents, but its data {tmp_path / 'gone.txt'} is not here: priced one document " \
        "per sequence" in note
    unpacked, _ = _estimate_json(capsys, "--config", _packed_run_file(tmp_path, texts, pack_documents=False))
    assert priced == unpacked
