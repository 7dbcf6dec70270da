"""Tokenizer, embedded corpus, packing, splits, batches and padding."""

from __future__ import annotations

import pytest
import torch

from orangetron.train.data import (
    FILE_SEPARATOR,
    BatchIterator,
    pack_sequences,
    pad_to_multiple,
    read_text_files,
    split_train_eval,
    stdlib_corpus,
)
from orangetron.train.tokenizer import ByteTokenizer

torch.set_num_threads(1)


# ---- tokenizer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello, world\n", "naïve café — 東京 🍊", "\x00\x7f"])
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    t = tok.encode_tensor(text)
    assert t.dtype == torch.long and t.tolist() == ids
    assert tok.decode(t) == text


def test_tokenizer_non_ascii_is_multi_byte_and_invalid_bytes_are_replaced() -> None:
    tok = ByteTokenizer()
    assert len(tok.encode("é")) == 2
    assert tok.decode([0xC3]) == "\ufffd"  # a truncated two-byte character
    with pytest.raises(ValueError, match="256"):
        tok.decode([256])


# ---- corpus -------------------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_non_empty_and_capped() -> None:
    a = stdlib_corpus(200_000)
    assert a == stdlib_corpus(200_000)
    assert 190_000 < len(a.encode("utf-8")) <= 200_000
    assert "def " in a and "import " in a


def _fake_stdlib(root) -> None:
    files = {
        "abc.py": "ABC = 1\n",
        "zzz.py": "ZZZ = 1\n",
        "pkg/mod.py": "MOD = 1\n",
        "test/test_x.py": "TEST_DIR = 1\n",
        "pkg/tests/t.py": "TESTS_DIR = 1\n",
        "idlelib/run.py": "IDLE = 1\n",
        "site-packages/thirdparty.py": "THIRD = 1\n",
        "notes.txt": "NOT_PY = 1\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_stdlib_corpus_order_and_exclusions(tmp_path) -> None:
    _fake_stdlib(tmp_path)
    corpus = stdlib_corpus(10_000, root=tmp_path)
    assert corpus == FILE_SEPARATOR.join(["ABC = 1\n", "MOD = 1\n", "ZZZ = 1\n"]) + FILE_SEPARATOR
    for excluded in ("TEST_DIR", "TESTS_DIR", "IDLE", "THIRD", "NOT_PY"):
        assert excluded not in corpus


def test_real_stdlib_corpus_excludes_test_suites() -> None:
    corpus = stdlib_corpus(3_000_000)
    # Markers that only appear in Lib/test and Lib/idlelib.
    assert "from test import support" not in corpus
    assert "from test.support import" not in corpus
    assert "from idlelib" not in corpus


def test_stdlib_corpus_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no standard-library"):
        stdlib_corpus(1000, root=tmp_path)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(0)


def test_stdlib_corpus_cut_never_splits_a_character(tmp_path) -> None:
    (tmp_path / "a.py").write_text("é" * 10, encoding="utf-8")
    assert stdlib_corpus(5, root=tmp_path) == "éé"  # 5 bytes: two whole characters, half of one dropped


def test_read_text_files(tmp_path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first")
    b.write_text("second é", encoding="utf-8")
    assert read_text_files([a, b]) == "first" + FILE_SEPARATOR + "second é"
    b.write_bytes(b"second \xff")  # not UTF-8: refused, not trained on as U+FFFD
    with pytest.raises(ValueError, match=r"b.txt' is not UTF-8 text \(byte 7: b'\\xff'\)"):
        read_text_files([a, b])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_text_files([a, tmp_path / "missing.txt"])
    with pytest.raises(ValueError):
        read_text_files([])


# ---- packing, split, batches --------------------------------------------------------------------------


def test_pack_sequences_by_hand() -> None:
    tokens = torch.arange(10)
    w = pack_sequences(tokens, 3)  # windows start every 3 tokens, 4 long; token 9 never fits a window
    assert w.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    inputs, labels = w[:, :-1], w[:, 1:]
    assert inputs.flatten().tolist() == list(range(9))  # inputs tile the stream, no overlap
    assert labels.flatten().tolist() == list(range(1, 10))  # each label is the next input token
    assert pack_sequences(torch.arange(11), 3).shape == (3, 4)  # tail 10 dropped
    assert pack_sequences(torch.arange(4), 3).shape == (1, 4)


def test_pack_sequences_errors() -> None:
    with pytest.raises(ValueError, match="seq_len=8"):
        pack_sequences(torch.arange(8), 8)
    with pytest.raises(ValueError, match="seq_len=0"):
        pack_sequences(torch.arange(8), 0)
    with pytest.raises(ValueError, match="1-D"):
        pack_sequences(torch.zeros(2, 8, dtype=torch.long), 2)


def test_split_train_eval_sizes_and_no_overlap() -> None:
    tokens = torch.arange(1000)
    train, held_out = split_train_eval(tokens, 0.1)
    assert train.numel() == 900 and held_out.numel() == 100
    assert torch.equal(torch.cat([train, held_out]), tokens)  # eval is the end of the stream
    assert set(train.tolist()).isdisjoint(held_out.tolist())
    # Packing each split separately: no window crosses the boundary.
    assert pack_sequences(train, 16).max() < 900 and pack_sequences(held_out, 16).min() >= 900
    assert split_train_eval(tokens, 0.0)[1].numel() == 0
    with pytest.raises(ValueError, match="eval_fraction"):
        split_train_eval(tokens, 1.0)


def test_batch_iterator_deterministic_and_covers_each_sample_once_per_epoch() -> None:
    samples = torch.arange(10).unsqueeze(1).repeat(1, 3)  # [10, 3], row i is all i
    it = BatchIterator(samples, batch_size=4, seed=7)
    assert len(it) == 3
    epoch0 = list(it.epoch(0))
    assert [b.shape[0] for b in epoch0] == [4, 4, 2]
    assert sorted(torch.cat(epoch0)[:, 0].tolist()) == list(range(10))
    assert torch.equal(torch.cat(epoch0), torch.cat(list(BatchIterator(samples, 4, seed=7).epoch(0))))
    assert not torch.equal(it.order(0), it.order(1))  # a fresh shuffle each epoch
    assert not torch.equal(it.order(0), BatchIterator(samples, 4, seed=8).order(0))
    # The endless iterator walks epoch 0 then epoch 1.
    stream = iter(it)
    first = [next(stream) for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(first, epoch0 + list(it.epoch(1)), strict=True))


def test_batch_iterator_drop_last() -> None:
    samples = torch.arange(10).unsqueeze(1)
    it = BatchIterator(samples, batch_size=4, seed=0, drop_last=True)
    assert len(it) == 2 and all(b.shape[0] == 4 for b in it.epoch(0))
    with pytest.raises(ValueError, match="batch_size=11"):
        BatchIterator(samples, batch_size=11, drop_last=True)
    with pytest.raises(ValueError, match="batch_size=0"):
        BatchIterator(samples, batch_size=0)


# ---- padding ------------------------------------------------------------------------------------------


def test_pad_to_multiple_shapes() -> None:
    inputs = torch.arange(14).reshape(2, 7)
    labels = inputs + 1
    pi, pl = pad_to_multiple(inputs, labels, 4)
    assert pi.shape == pl.shape == (2, 8)
    assert torch.equal(pi[:, :7], inputs) and torch.equal(pl[:, :7], labels)
    assert pi[:, 7].tolist() == [0, 0] and pl[:, 7].tolist() == [-100, -100]
    same_i, same_l = pad_to_multiple(inputs, labels, 7)
    assert same_i is inputs and same_l is labels


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_pad_to_multiple_keeps_loss_and_grads(preset: str) -> None:
    from orangetron.model import Transformer, model_preset

    model = Transformer(model_preset(preset), seed=0, dtype=torch.float64)
    samples = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    inputs, labels = samples[:, :-1], samples[:, 1:]  # S = 10
    padded_inputs, padded_labels = pad_to_multiple(inputs, labels, 2 * 3)  # as for cp=3: S -> 12
    assert padded_inputs.shape[1] == 12

    def loss_and_grads(i: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = model.loss(i, lab)  # MoE: the load-balancing loss skips padded positions as well
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(inputs, labels)
    padded_loss, padded_grads = loss_and_grads(padded_inputs, padded_labels)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-12, atol=0)
    assert len(padded_grads) == len(grads)
    for g_pad, g in zip(padded_grads, grads, strict=True):
        torch.testing.assert_close(g_pad, g, rtol=1e-9, atol=1e-13)
    if preset == "tiny":  # dense: the full objective is unchanged too
        torch.testing.assert_close(model.loss(padded_inputs, padded_labels), model.loss(inputs, labels),
                                   rtol=1e-12, atol=0)
