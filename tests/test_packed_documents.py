"""Packed documents on one device, in float64: block-diagonal causal attention from document ids against an
explicit dense mask in plain torch, rotary positions restarting in each document, and the whole model on a
packed row against the same documents run one by one."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from trainer_reference import assert_matches_reference, reference_training

from orangetron import memory
from orangetron.model import ModelConfig, Transformer, model_preset
from orangetron.model.attention import document_attention
from orangetron.model.documents import DocumentIdsError, Documents
from orangetron.parallel.recompute import apply_recompute
from orangetron.plan.timing import model_flops_per_step
from orangetron.spec.options import Job
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.data import document_ids, pack_documents, packed_inputs
from orangetron.train.datasets import PreparedDataset
from orangetron.train.mfu import batch_flops, step_flops
from orangetron.train.prepare import prepare_data, train_tokenizer
from orangetron.train.trainer import load_data, train

HEAD_DIM = 4
# Two rows of 16 tokens with different boundaries: one-token documents, short ones and a long one.
ROW_LENGTHS = ((1, 3, 2, 9, 1), (7, 1, 8))


def ids_of(lengths_per_row: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Document ids [B, S] from each row's document lengths (ids 10, 11, ...: only equality matters)."""
    return torch.stack([torch.cat([torch.full((n,), 10 + d) for d, n in enumerate(row)]) for row in lengths_per_row])


def dense_block_causal(ids: torch.Tensor) -> torch.Tensor:
    """visible [B, S, S]: key j to query i iff j <= i and both carry the same document id."""
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return causal & (ids.unsqueeze(2) == ids.unsqueeze(1))


def plain_attention(q, k, v, visible):
    group = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) / HEAD_DIM**0.5  # [B, H, S, S]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2)


def qkv_weight(ids: torch.Tensor, hq: int, hk: int):
    g = torch.Generator().manual_seed(hq * 7 + hk)
    b, s = ids.shape
    shapes = ((b, s, hq, HEAD_DIM), (b, s, hk, HEAD_DIM), (b, s, hk, HEAD_DIM), (b, s, hq, HEAD_DIM))
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]


def grads(fn, q, k, v, weight):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize(("hq", "hk"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("rows", [ROW_LENGTHS, (ROW_LENGTHS[0], ROW_LENGTHS[0])])
def test_document_attention_matches_a_dense_block_diagonal_mask(impl, hq, hk, rows):
    ids = ids_of(rows)
    q, k, v, weight = qkv_weight(ids, hq, hk)
    documents = Documents.from_ids(ids)
    got = grads(lambda q, k, v: document_attention(q, k, v, documents, impl=impl)[0], q, k, v, weight)
    want = grads(lambda q, k, v: plain_attention(q, k, v, dense_block_causal(ids)), q, k, v, weight)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


def test_document_attention_lse_is_that_of_each_document():
    ids = ids_of(ROW_LENGTHS)
    q, k, v, _ = qkv_weight(ids, 2, 2)
    _, lse = document_attention(q, k, v, Documents.from_ids(ids))
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / HEAD_DIM**0.5
    want = scores.masked_fill(~dense_block_causal(ids).unsqueeze(1), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, want, rtol=1e-9, atol=1e-12)


def test_positions_restart_in_each_document_and_split_documents_are_refused():
    documents = Documents.from_ids(torch.tensor([[5, 5, 2, 7, 7, 7], [1, 1, 1, 1, 1, 1]]))
    assert documents.positions().tolist() == [[0, 1, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert documents.spans == (((0, 2), (2, 3), (3, 6)), ((0, 6),))
    with pytest.raises(DocumentIdsError, match="split"):
        Documents.from_ids(torch.tensor([3, 3, 4, 3]))


MODEL = ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, max_seq_len=32)


@pytest.mark.parametrize(("impl", "recompute"), [("fused", "none"), ("reference", "none"), ("fused", "full")])
def test_model_on_a_packed_row_equals_each_document_alone(impl, recompute):
    """Logits and every gradient of a packed row equal those of its documents run as separate sequences (each
    from position 0, plain causal attention): no document leaks into another, in either direction. Replayed
    blocks (activation recompute) replay with the same documents."""
    tokens = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(3))
    ids = ids_of(ROW_LENGTHS[:1])
    weight = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    packed, alone = (Transformer(MODEL, seed=1, dtype=torch.float64) for _ in range(2))
    for model in (packed, alone):
        for layer in model.layers:
            layer.attention.kernel_impl = impl
    apply_recompute(packed, 1, 1, recompute, 0)
    logits = packed(tokens, documents=Documents.from_ids(ids))
    (logits * weight).sum().backward()
    pieces, start = [], 0
    for n in ROW_LENGTHS[0]:
        piece = alone(tokens[:, start : start + n])
        (piece * weight[:, start : start + n]).sum().backward()
        pieces.append(piece)
        start += n
    torch.testing.assert_close(logits, torch.cat(pieces, dim=1), rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


# ---- data and the trainer ------------------------------------------------------------------------------


def test_packed_samples_ignore_the_label_after_each_documents_last_token():
    tokens = torch.arange(100, 112)
    ids = document_ids([1, 4, 7])  # 0 | 1 1 1 1 | 2 2 2 2 2 2 2
    samples = pack_documents(tokens, ids, 5)  # two windows of 6
    assert samples.shape == (2, 6, 2)
    inputs, labels, documents = packed_inputs(samples)
    assert inputs.tolist() == [[100, 101, 102, 103, 104], [105, 106, 107, 108, 109]]
    assert labels.tolist() == [[-100, 102, 103, 104, -100], [106, 107, 108, 109, 110]]
    # A document continued from the previous window starts at position 0 in this one.
    assert documents.positions().tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert documents.spans == (((0, 1), (1, 5)), ((0, 5),))


def test_prepared_windows_carry_the_document_of_every_token(tmp_path):
    files = []
    for i, text in enumerate(["a", "bcdef", "ghijklmnopqrstu", "vw"]):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text)
    prepare_data([str(f) for f in files], tmp_path / "ds", "byte", progress=False)
    dataset = PreparedDataset.open(tmp_path / "ds")
    offsets = dataset.document_offsets().tolist()
    windows = dataset.windows(0, len(dataset), 6, documents=True)
    got = windows[torch.arange(len(windows))]
    for w in range(len(windows)):
        for j in range(7):
            at = w * 6 + j
            want = max(d for d in range(len(offsets) - 1) if offsets[d] <= at)  # the document holding token `at`
            assert got[w, j].tolist() == [int(dataset.tokens[at]), want]


def uneven_files(tmp_path, count: int = 40) -> list[str]:
    g = torch.Generator().manual_seed(5)
    paths = []
    for i in range(count):
        n = int(torch.randint(1, 40, (), generator=g))
        (tmp_path / f"doc{i}.txt").write_text("".join(chr(97 + (i + j) % 26) for j in range(n)))
        paths.append(str(tmp_path / f"doc{i}.txt"))
    return paths


def test_one_rank_packed_training_matches_plain_torch_with_dense_masks(tmp_path):
    """Files of 1 to 39 bytes, windows of 16: most windows cross documents. The trainer's float64 run equals the
    plain-torch reference with explicit masks, and differs from the same run unpacked (the masks act)."""
    options = dict(model="tiny", data=uneven_files(tmp_path), seq_len=16, batch_size=4, steps=3, warmup=1,
                   eval_batches=2, param_dtype="float64")
    cfg = TrainConfig(**options, out=str(tmp_path / "run"), save_every=3, pack_documents=True)
    result = train(cfg, progress=False)
    assert_matches_reference(result, tmp_path / "run", reference_training(cfg), rtol=1e-9)
    assert "pack_documents = true" in (tmp_path / "run" / "config.toml").read_text()
    plain = train(TrainConfig(**options, pack_documents=False), progress=False)
    assert abs(plain["losses"][0] - result["losses"][0]) > 1e-3
    # MFU counts the attention the run computed: each document's own, batch by batch (the FLOPs a step's
    # `step_mfu` and `step_tokens_per_s` imply), not the window's 16 x 16.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    batches = load_data(cfg).train.from_sample(0)
    tokens = cfg.batch_size * cfg.seq_len
    for record, batch in zip(records, batches, strict=False):
        implied = record["step_mfu"] / record["step_tokens_per_s"] * tokens * result["peak_flops"]
        assert implied == pytest.approx(batch_flops(cfg, batch), rel=1e-9) and implied < step_flops(cfg)
    timed = records[1:]  # the first step also measures memory: the running figure leaves it out
    seconds = [tokens / r["step_tokens_per_s"] for r in timed]
    flops = [r["step_mfu"] * s * result["peak_flops"] for r, s in zip(timed, seconds, strict=True)]
    assert records[-1]["mfu"] == pytest.approx(sum(flops) / sum(seconds) / result["peak_flops"], rel=1e-9)


def test_a_packed_batchs_flops_count_each_documents_own_attention():
    """By hand: rows of pieces 4 + 4 and 8 tokens, Σ n^2 / tokens = (16 + 16 + 64) / 16 = 6 keys per query on
    average, so the step's FLOPs per token are those of 6-token sequences."""
    cfg = TrainConfig(model="tiny", seq_len=8, batch_size=2, steps=2, warmup=1, corpus_bytes=60_000)
    ids = torch.tensor([[5, 5, 5, 5, 6, 6, 6, 6, 6], [6, 6, 6, 6, 6, 6, 6, 6, 7]])  # a document continued
    batch = torch.stack([torch.zeros_like(ids), ids], dim=-1)
    six = model_flops_per_step(cfg.model_config(), Job(seq_len=6), 1) / 6
    assert batch_flops(cfg, batch) / 16 == pytest.approx(six, rel=1e-12)
    assert batch_flops(cfg, batch[..., 0]) == step_flops(cfg)  # unpacked rows: the window's s x s


def test_packing_is_on_by_default_for_prepared_data_only(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 4000)
    prepare_data([str(tmp_path / "a.txt")], tmp_path / "ds", "byte", progress=False)
    assert TrainConfig(model="tiny", data=[str(tmp_path / "ds")]).pack_documents is True
    assert TrainConfig(model="tiny", data=[str(tmp_path / "ds")], pack_documents=False).pack_documents is False
    assert TrainConfig(model="tiny").pack_documents is False
    bpe = train_tokenizer([str(tmp_path / "a.txt")], tmp_path / "bpe", vocab=260)
    with pytest.raises(TrainConfigError, match="--pack-documents.*not the byte tokenizer"):  # BPE: bytes are not tokens
        TrainConfig(model=ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=24),
                    data=[str(tmp_path / "a.txt")], tokenizer=str(bpe), pack_documents=True)
    # A resume restores packing from a run on a prepared dataset: text given to it is refused for what it is.
    with pytest.raises(TrainConfigError, match=r"keeps its record's packing: it trained on a prepared dataset, so new "
                                               r"data comes prepared, with --new-data\)$"):
        TrainConfig(model=ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=24),
                    data=[str(tmp_path / "a.txt")], tokenizer=str(bpe), pack_documents=True, resume=True,
                    out=str(tmp_path / "run"))


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, sequence_parallel=True), dict(dp=2, ep=2),
                                    dict(cp=2, tp=2, sequence_parallel=True, cp_mode="ring"),
                                    dict(cp=3, cp_mode="allgather"),
                                    dict(tp=2, cp=2, pp=2, sequence_parallel=True, cp_mode="usp", ulysses_degree=2)],
                         ids=["tp2-pp2-sp", "dp2-ep2", "tp2-cp2-sp-ring", "cp3-allgather", "tp2-cp2-pp2-usp"])
def test_parallel_packed_training_matches_plain_torch_with_dense_masks(tmp_path, layout):
    """The documents travel with every micro-batch through tensor parallelism (sequence-parallel included), both
    pipeline stages, data and expert parallelism: float64 losses, gradient norms, parameters and moments equal
    the plain-torch reference with explicit masks. Micro-batches and dp ranks count unequal numbers of labels
    (a boundary's label is ignored), and the loss is still the mean over the batch's labels. The balancing loss
    is off: per micro-batch it is not the whole batch's."""
    model = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0)
    cfg = TrainConfig(model=model, data=uneven_files(tmp_path), seq_len=16, batch_size=8, microbatches=2, steps=3,
                      warmup=1, eval_batches=2, param_dtype="float64", pack_documents=True,
                      out=str(tmp_path / "run"), save_every=3, **layout)
    result = train(cfg, progress=False)
    assert_matches_reference(result, tmp_path / "run", reference_training(cfg), rtol=1e-9)


def test_packed_attention_keeps_what_one_causal_call_keeps():
    """The per-document calls keep q, k, v, the whole output and its log-sum-exp once, as one causal call does:
    the saved activations of a packed forward equal those of a plain one (same positions, so equal RoPE tables)."""
    model = Transformer(MODEL, seed=1, dtype=torch.float64)
    tokens = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    peaks = []
    for documents in (None, Documents.from_ids(ids_of(ROW_LENGTHS))):
        with memory.track_activations(model) as meter:
            model(tokens, position_ids=torch.arange(16), documents=documents).sum().backward()
        peaks.append(meter.peak_bytes)
    assert peaks[0] > 0 and peaks[1] == peaks[0]


def test_a_planned_run_packs_a_prepared_dataset_as_a_plain_run_does(tmp_path, capsys):
    """`plan --emit-config` wrote `pack_documents = false` (resolved with no data), so `train --config plan.toml
    --data DATASET` trained across the dataset's document boundaries, unsaid, where `train --data DATASET`
    packs. The file leaves packing to the data."""
    from orangetron import cli

    (tmp_path / "a.txt").write_text("first document\n\n\nsecond one, longer " * 40)
    prepare_data([str(tmp_path / "a.txt")], tmp_path / "ds", "byte", progress=False)
    plan = tmp_path / "plan.toml"
    assert cli.main(["plan", "--model", "tiny", "--gpus", "1", "--seq", "32", "--global-batch", "2",
                     "--param-dtype", "float64", "--emit-config", str(plan)]) == 0
    assert "pack_documents" not in plan.read_text()
    capsys.readouterr()
    assert cli.main(["train", "--config", str(plan), "--data", str(tmp_path / "ds"), "--steps", "1",
                     "--out", str(tmp_path / "run")]) == 0
    assert "pack_documents = true" in (tmp_path / "run" / "config.toml").read_text()
    assert f"prepared dataset {tmp_path / 'ds'} in packed documents, " in capsys.readouterr().err  # said at start
