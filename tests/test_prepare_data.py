"""Tokenizers (ids as transformers' AutoTokenizer gives them) and prepared datasets (`prepare-data`, then
`train --data DIR`, resumed on the same token stream)."""

from __future__ import annotations

import io
import json
import re
import tomllib
from itertools import islice

import numpy as np
import pytest
import torch

from orangetron.cli import main
from orangetron.cli.wording import counted
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.corpus import read_text_documents, stdlib_corpus
from orangetron.train.datasets import PreparedDataset, TokenWindows
from orangetron.train.prepare import ByteProgress, prepare_data, train_tokenizer
from orangetron.train.tokenizer import ByteTokenizer, HFTokenizer
from orangetron.train.trainer import load_data, train

TEXTS = ["def f(x):\n    return x + 1\n", "Ünïcödé — ✓ 你好", "a <|endoftext|> b", "", "   spaces  "]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus.txt").write_text(stdlib_corpus(40_000), encoding="utf-8")
    return train_tokenizer([str(root / "corpus.txt")], root / "bpe", vocab=300)


def _variant(src, dst, post_processor=None, **config):
    """A copy of the tokenizer at `src` with tokenizer_config.json entries and perhaps another post-processor."""
    from tokenizers import Tokenizer

    dst.mkdir()
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    if post_processor is not None:
        tok.post_processor = post_processor
    tok.save(str(dst / "tokenizer.json"))
    base = json.loads((src / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return dst


def test_ids_equal_autotokenizer_bos_and_eos_included(tokenizer_dir, tmp_path):
    """The special tokens come from tokenizer.json's post-processor (a Llama 3 style template adding BOS, or
    none), as transformers 5 has it; tokenizer_config.json's add_bos_token is dropped by both."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import processors

    eos = HFTokenizer(tokenizer_dir).eos_id
    template = processors.TemplateProcessing(single="<|endoftext|> $A <|endoftext|>", pair="$A $B",
                                             special_tokens=[("<|endoftext|>", eos)])
    variants = {"trained": tokenizer_dir,
                "template": _variant(tokenizer_dir, tmp_path / "template", template),
                "flags": _variant(tokenizer_dir, tmp_path / "flags", add_bos_token=True, add_eos_token=True)}
    for name, folder in variants.items():
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        # ...and a checkpoint's copy of the files encodes as the folder did (sample and export read that copy)
        for ours in (HFTokenizer(folder), HFTokenizer.from_kept(HFTokenizer(folder).kept_files(), str(folder))):
            for text in TEXTS:
                assert ours.encode(text) == theirs(text)["input_ids"], (name, text)
                assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"])
            assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    with_template = HFTokenizer(variants["template"]).encode("x")
    assert with_template[0] == eos and with_template[-1] == eos and len(with_template) == 3
    assert eos not in HFTokenizer(tokenizer_dir).encode("x")  # the trained tokenizer adds neither
    assert HFTokenizer(tokenizer_dir / "tokenizer.json").encode(TEXTS[0]) == HFTokenizer(tokenizer_dir).encode(TEXTS[0])


def _corpus(tmp_path):
    docs = [stdlib_corpus(3000)[i * 500:(i + 1) * 500] for i in range(4)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:3])))
    text = tmp_path / "last.txt"
    text.write_text(docs[3], encoding="utf-8")
    return docs, [str(jsonl), str(text)]


def test_progress_reads_in_a_unit_its_input_is_not_zero_in():
    small, large = io.StringIO(), io.StringIO()
    bar = ByteProgress(3000, enabled=True, stream=small)
    bar.advance(3000, 3001)
    bar = ByteProgress(5 * 2**30, enabled=True, stream=large)
    bar.advance(5 * 2**30, 7)
    assert " 2.9 KiB, 3,001 tokens, " in small.getvalue()  # 3000 bytes: not "0.0 MiB"
    assert " 5.0 GiB, 7 tokens, " in large.getvalue() and large.getvalue().rstrip().endswith(" GiB/s")
    empty = io.StringIO()  # a 0-byte file was read as "1.0 B"
    ByteProgress(0, enabled=True, stream=empty).advance(0, 0)
    assert empty.getvalue().startswith("[########################] 100.0% 0.0 B, 0 tokens, ")


def test_progress_ends_at_the_whole_input_with_blank_lines_in_it(tmp_path):
    """Blank JSON Lines lines are read but no document takes their bytes: the bar stopped at 99.2%."""
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n\n\n{"text": "b"}\n\n')
    bar = io.StringIO()
    prepare_data([str(tmp_path / "a.jsonl")], tmp_path / "data", "byte", stream=bar)
    assert bar.getvalue().splitlines()[-1].startswith("[########################] 100.0% 31.0 B, ")  # 14+1+1+14+1


def test_prepare_data_writes_each_document_then_eos(tokenizer_dir, tmp_path):
    docs, files = _corpus(tmp_path)
    bar = io.StringIO()
    meta = prepare_data(files, tmp_path / "data", str(tokenizer_dir), stream=bar)
    tok = HFTokenizer(tokenizer_dir)
    expected = [i for d in docs for i in tok.encode(d) + [tok.eos_id]]
    tokens = np.fromfile(tmp_path / "data" / "tokens.bin", dtype="<u2")
    assert tokens.tolist() == expected and meta["tokens"] == len(expected) and meta["dtype"] == "uint16"
    offsets = np.load(tmp_path / "data" / "documents.npy").tolist()
    assert offsets[0] == 0 and offsets[-1] == len(expected) and len(offsets) == 5
    assert all(tokens[end - 1] == tok.eos_id for end in offsets[1:])
    assert "100.0%" in bar.getvalue()  # the progress bar reached the end (a line per tenth off a terminal)
    with pytest.raises(ValueError, match=r"exists; choose another name, or add --overwrite to move it aside"):
        prepare_data(files, tmp_path / "data", str(tokenizer_dir))
    moved: list = []  # with --overwrite the former dataset moves aside, whole, once the new one is written
    again = prepare_data(files[:1], tmp_path / "data", str(tokenizer_dir), overwrite=True, moved=moved)
    assert moved == [tmp_path / "data.previous-1"] and again["tokens"] < meta["tokens"]
    assert np.fromfile(moved[0] / "tokens.bin", dtype="<u2").tolist() == expected
    with pytest.raises(ValueError, match=r"holds a file it tokenizes"):  # what it reads cannot move aside
        prepare_data([str(tmp_path / "data" / "dataset.json")], tmp_path / "data", str(tokenizer_dir),
                     overwrite=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object with a \"text\" string"):
        prepare_data([str(bad)], tmp_path / "other", str(tokenizer_dir))
    assert not (tmp_path / "other").exists()  # nothing half written
    with pytest.raises(ValueError, match=r": a folder; give its files"):  # it said "no such file"
        prepare_data([str(tmp_path / "data")], tmp_path / "other", str(tokenizer_dir))


def test_empty_documents_are_left_out_and_counted_and_no_text_at_all_is_refused(tmp_path, capsys):
    """An empty file became a document of EOS alone, and a corpus of them a dataset of separators."""
    docs, files = _corpus(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    assert main(["prepare-data", "-o", str(tmp_path / "data"), str(tmp_path / "empty.txt"), *files,
                 str(tmp_path / "blank.jsonl"), "--quiet", "--json"]) == 0
    tokens = np.fromfile(tmp_path / "data" / "tokens.bin", dtype="<u2")
    assert bytes(tokens.tolist()).decode() == "".join(d + "\n\n\n" for d in docs)
    assert len(np.load(tmp_path / "data" / "documents.npy")) == len(docs) + 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["documents"] == len(docs) and summary["empty_documents_skipped"] == 2  # the text line's count
    assert f"{len(docs)} documents (2 empty ones left out), " in captured.err
    assert main(["prepare-data", "-o", str(tmp_path / "none"), str(tmp_path / "empty.txt")]) == 2
    assert "no text to tokenize (every document is empty)" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    assert (counted(1, "empty one"), counted(1024, "token")) == ("1 empty one", "1,024 tokens")  # "1 documents"


def test_train_prepare_data_and_tokenizer_train_read_a_file_alike(tmp_path):
    """`train --data x.jsonl` trained on the file's JSON, braces and keys, where prepare-data and tokenizer train
    read its documents; a "text" of null or a list became the text "None" or "['a']"; a byte-order mark was a
    bad first line of JSON Lines and text of a text file."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "first doc"}\n\n{"text": "second"}\n')
    (tmp_path / "b.txt").write_bytes(bom + "third é".encode())
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]
    joined = "first doc\n\n\nsecond\n\n\nthird é"
    assert "".join(read_text_documents(files)) == joined
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    assert bytes(np.fromfile(tmp_path / "data" / "tokens.bin", dtype="<u2").tolist()).decode() == joined + "\n\n\n"
    bad = {"null.jsonl": b'{"text": "ok"}\n{"text": null}\n', "list.jsonl": b'{"text": ["a"]}\n',
           "array.json": b'[\n{"text": "a"}\n]\n', "bytes.jsonl": b'{"text": "ok"}\n{"text": "\xff"}\n',
           "surrogate.jsonl": b'{"text": "a\\ud800b"}\n'}  # a tokenizer's TypeError, as a traceback
    said = {"null.jsonl": r'null.jsonl:2: not a JSON object with a "text" string \("text" is null\)',
            "list.jsonl": r'list.jsonl:1: not a JSON object with a "text" string \("text" is \["a"\]\)',
            "array.json": r"array.json:1: .* \(JSON Lines holds one object per line; this file opens a JSON array\)",
            "bytes.jsonl": r"bytes.jsonl', line 2, is not UTF-8 text \(byte 10: b'\\xff'\)",
            "surrogate.jsonl": r'surrogate.jsonl:1: "text" holds .*, half of a UTF-16 surrogate pair, which is not '
                               r'text'}
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
        for read in (lambda f: read_text_documents(f), lambda f: prepare_data(f, tmp_path / "no", "byte"),
                     lambda f: train_tokenizer(f, tmp_path / "no", 300)):
            with pytest.raises(ValueError, match=said[name]):
                read([str(tmp_path / name)])
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="empty.txt: no text to train on"):  # it wrote a tokenizer of bytes
        train_tokenizer([str(tmp_path / "empty.txt")], tmp_path / "no", 300)
    assert not (tmp_path / "no").exists()


def test_byte_tokenizer_separates_documents_as_text_files_are_joined(tmp_path):
    docs, files = _corpus(tmp_path)
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    tokens = np.fromfile(tmp_path / "data" / "tokens.bin", dtype="<u2")
    assert bytes(tokens.tolist()).decode() == "".join(d + "\n\n\n" for d in docs)
    assert ByteTokenizer().eos_id is None


def _cfg(data, **options):
    return TrainConfig(model="tiny", data=[str(data)], seq_len=16, batch_size=4, steps=4, warmup=0,
                       eval_batches=2, **options)


def test_train_reads_a_prepared_dataset_through_a_memory_map(tmp_path):
    _, files = _corpus(tmp_path)
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    cfg = _cfg(tmp_path / "data")
    assert cfg.prepared_data == str(tmp_path / "data") and cfg.tokenizer == "byte"
    data = load_data(cfg)
    assert isinstance(data.train.samples, TokenWindows) and isinstance(data.train.samples.tokens, np.memmap)
    stream = torch.from_numpy(np.fromfile(tmp_path / "data" / "tokens.bin", dtype="<u2").astype(np.int64))
    first = next(iter(data.train))
    assert cfg.pack_documents and first.shape == (4, 17, 2)  # packed by default: (token, document) pairs
    for row in first[..., 0]:  # every sample is a window of the stream at a multiple of seq_len
        starts = [s for s in range(0, stream.numel() - 16, 16) if torch.equal(stream[s:s + 17], row)]
        assert starts
    with pytest.raises(TrainConfigError, match=r"a folder, not a text file"):
        _cfg(tmp_path)  # a folder that is not a prepared dataset keeps today's message
    with pytest.raises(TrainConfigError, match=r"was tokenized with 'byte'"):
        _cfg(tmp_path / "data", tokenizer=str(tmp_path))


def test_a_cursor_continues_the_stream_without_drawing_the_batches_before_it(tmp_path):
    _, files = _corpus(tmp_path)
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    windows = PreparedDataset.open(tmp_path / "data").windows(0, 2000, 16)
    from orangetron.train.data import BatchIterator

    batches = BatchIterator(windows, 4, seed=3, drop_last=True)
    straight = list(islice(iter(batches), 3 * len(batches)))
    for k in (1, len(batches) - 1, len(batches) + 2):
        resumed = list(islice(batches.from_sample(4 * k), 3))
        assert all(torch.equal(a, b) for a, b in zip(resumed, straight[k:k + 3], strict=True))


def test_a_resumed_run_sees_the_token_stream_of_an_uninterrupted_one(tmp_path):
    _, files = _corpus(tmp_path)
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    straight = train(_cfg(tmp_path / "data", out=str(tmp_path / "straight")), progress=False)
    train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), stop_after=2), progress=False)
    resumed = train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), resume=True), progress=False)
    assert resumed["losses"] == straight["losses"]  # bitwise: the same batches, in the same order
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-00000002/state.json")).read_text())
    assert state["data"] == {"batches": 2, "samples": 8}
    record = tomllib.loads((tmp_path / "run" / "config.toml").read_text())["data_record"]
    assert record["source"] == "prepared" and record["path"] == str((tmp_path / "data").absolute())
    assert record["tokenizer"] == "byte" and len(record["sha256"]) == 64 and record["tokens"] > 0


def test_readme_path_tokenizer_prepare_data_train_sample(tmp_path, capsys, tokenizer_dir):
    """`tokenizer train` -> `prepare-data` -> `train --data DIR` -> `sample` decodes with the run's tokenizer."""
    _, files = _corpus(tmp_path)
    model = tmp_path / "model.toml"
    model.write_text('hidden_size = 32\nnum_layers = 1\nnum_heads = 2\nvocab_size = 320\nffn_hidden_size = 64\n'
                     'max_seq_len = 64\n')
    assert main(["tokenizer", "train", *files, "-o", str(tmp_path / "tok"), "--vocab", "290"]) == 0
    assert main(["prepare-data", "--tokenizer", str(tmp_path / "tok"), "-o", str(tmp_path / "data"), *files,
                 "--quiet"]) == 0
    assert main(["train", "--model", str(model), "--data", str(tmp_path / "data"), "--steps", "2", "--seq-len", "16",
                 "--batch-size", "4", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = HFTokenizer(tmp_path / "tok")
    assert result["text"] == tok.decode(result["tokens"]) and len(result["tokens"]) == 5
    assert result["stop_ids"] == [tok.eos_id] == [0]  # the documents' end, which a sample stops after
    # the export names the same end for transformers' generate, and the BOS, as config.json's token ids
    assert main(["export", str(tmp_path / "run"), "--hf", "-o", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (tok.eos_id, tok.bos_id)
    assert main(["train", "--model", str(model), "--data", str(tmp_path / "data"), "--tokenizer", "byte"]) == 2


def test_a_token_file_edited_in_place_is_refused_on_resume_and_a_touched_copy_is_not(tmp_path):
    """An edit that keeps the token file's size left dataset.json (the recorded hash) as it was, and the resume
    trained on other tokens without a word."""
    import os

    _, files = _corpus(tmp_path)
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), stop_after=2), progress=False)
    tokens = tmp_path / "data" / "tokens.bin"
    os.utime(tokens, ns=(tokens.stat().st_atime_ns, tokens.stat().st_mtime_ns + 10**9))  # a copy: same bytes
    train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), stop_after=3, resume=True), progress=False)
    original = tokens.read_bytes()
    edited = bytearray(original)
    edited[:4] = bytes(4) if edited[:4] != bytes(4) else b"\x01\x01\x01\x01"
    tokens.write_bytes(bytes(edited))
    with pytest.raises(TrainConfigError, match="tokens.bin changed after `prepare-data` wrote it"):
        train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), resume=True), progress=False)
    tokens.write_bytes(bytes(original))
    train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), resume=True), progress=False)  # to its last step
    documents = tmp_path / "data" / "documents.npy"  # the boundaries, edited with their time set back
    before = documents.stat()
    offsets = np.load(documents)
    offsets[1] += 1
    np.save(documents, offsets)
    os.utime(documents, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(TrainConfigError, match="documents.npy changed after `prepare-data` wrote it"):
        train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), resume=True), progress=False)


def test_a_dataset_moved_aside_is_named_by_the_resume_it_refuses(tmp_path):
    """`prepare-data --overwrite` into the folder a run trained on moved its dataset to DIR.previous-1: the
    resume was refused without a word of where the run's data had gone."""
    _, files = _corpus(tmp_path)
    prepare_data(files, tmp_path / "data", "byte", progress=False)
    train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), stop_after=2), progress=False)
    prepare_data(files[:1], tmp_path / "data", "byte", progress=False, overwrite=True)
    with pytest.raises(TrainConfigError, match=re.escape(
            f"the run's dataset is at {tmp_path / 'data.previous-1'}, where an --overwrite moved it: give that "
            "with --data; or to continue on other data")):
        train(_cfg(tmp_path / "data", out=str(tmp_path / "run"), resume=True), progress=False)
    train(_cfg(tmp_path / "data.previous-1", out=str(tmp_path / "run"), resume=True), progress=False)


def test_a_tokenizer_trained_again_after_prepare_data_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text(stdlib_corpus(20_000), encoding="utf-8")
    bpe = train_tokenizer([str(tmp_path / "corpus.txt")], tmp_path / "bpe", vocab=300)
    prepare_data([str(tmp_path / "corpus.txt")], tmp_path / "data", str(bpe), progress=False)
    config = json.loads((bpe / "tokenizer_config.json").read_text())  # rewritten, every id kept: still the one
    (bpe / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}, indent=4))
    (bpe / "tokenizer.json").write_text(json.dumps(json.loads((bpe / "tokenizer.json").read_text()), indent=4))
    with pytest.raises(TrainConfigError, match="more than the model's vocab_size"):  # past the tokenizer's check
        _cfg(tmp_path / "data")
    train_tokenizer([str(tmp_path / "corpus.txt")], bpe, vocab=280, overwrite=True)
    with pytest.raises(TrainConfigError, match="its ids changed since the prepared dataset"):
        _cfg(tmp_path / "data")


def test_records_of_the_former_keys_are_still_checked(tmp_path):
    """A dataset.json of 2026-12-04 holds the tokenizer's file hash (`tokenizer_sha256`), and a run record of
    that day the token file's modification time (`modified_ns`): renamed keys left both unchecked."""
    (tmp_path / "corpus.txt").write_text(stdlib_corpus(20_000), encoding="utf-8")
    bpe = train_tokenizer([str(tmp_path / "corpus.txt")], tmp_path / "bpe", vocab=300)
    prepare_data([str(tmp_path / "corpus.txt")], tmp_path / "data", str(bpe), progress=False)
    meta_file = tmp_path / "data" / "dataset.json"
    meta = json.loads(meta_file.read_text())
    meta["tokenizer_sha256"] = HFTokenizer(bpe).files_sha256()
    del meta["tokenizer_ids_sha256"]
    meta_file.write_text(json.dumps(meta))
    train_tokenizer([str(tmp_path / "corpus.txt")], bpe, vocab=280, overwrite=True)
    with pytest.raises(TrainConfigError, match="its ids changed since the prepared dataset"):
        _cfg(tmp_path / "data")

    prepare_data([str(tmp_path / "corpus.txt")], tmp_path / "bytes", "byte", progress=False)
    train(_cfg(tmp_path / "bytes", out=str(tmp_path / "run"), stop_after=2), progress=False)
    record = tmp_path / "run" / "config.toml"
    tokens = tmp_path / "bytes" / "tokens.bin"
    text = re.sub(r"changed_ns = \d+", f"modified_ns = {tokens.stat().st_mtime_ns}", record.read_text())
    record.write_text(text)
    edited = bytearray(tokens.read_bytes())
    edited[:2] = edited[1::-1] if edited[0] != edited[1] else b"\x01\x02"
    tokens.write_bytes(bytes(edited))
    with pytest.raises(TrainConfigError, match="tokens.bin changed after `prepare-data` wrote it"):
        train(_cfg(tmp_path / "bytes", out=str(tmp_path / "run"), resume=True), progress=False)


def test_a_dataset_too_small_for_one_batch_is_refused_with_the_way_out(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("a few words\n")
    prepare_data([str(tmp_path / "a.txt")], tmp_path / "data", "byte", stream=io.StringIO())
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "data"), "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "the prepared dataset's training split has" in err and "only 0 samples of seq_len=32; prepare more " \
        "text (orangetron prepare-data) or lower --batch-size / --seq-len" in err


def test_a_json_lines_suffix_in_capitals_or_ndjson_is_read_as_json_lines(tmp_path):
    """`C.JSONL` (and `.ndjson`) was read as one text document: its braces and keys became training text."""
    from orangetron.train.corpus import file_documents

    for name in ("C.JSONL", "c.Json", "c.ndjson"):
        path = tmp_path / name
        path.write_text('{"text": "first"}\n{"text": "second"}\n')
        assert [text for text, _ in file_documents(path)] == ["first", "second"], name


def test_train_data_leaves_out_an_empty_record_as_prepare_data_does(tmp_path):
    """`train --data` read `{"text": ""}` as a document of the separator alone, where `prepare-data` skips it: the
    two read one file apart, though the docs say they read it alike."""
    from orangetron.train.corpus import FILE_SEPARATOR, read_text_documents

    (tmp_path / "e.jsonl").write_text('{"text": "aaa"}\n{"text": ""}\n{"text": "bbb"}\n')
    (tmp_path / "empty.txt").write_text("")
    files = [str(tmp_path / "e.jsonl"), str(tmp_path / "empty.txt")]
    assert read_text_documents(files) == ["aaa" + FILE_SEPARATOR, "bbb"]
    prepare_data(files, tmp_path / "data", "byte", stream=io.StringIO())
    meta = json.loads((tmp_path / "data" / "dataset.json").read_text())
    assert meta["empty_documents_skipped"] == 2 and meta["documents"] == 2


def test_a_run_into_its_own_dataset_folder_is_refused(tmp_path, capsys):
    """`train --data DS --out DS` wrote the run's record, metrics and checkpoints among the dataset's files (a run
    into its --hf-model or --tokenizer folder was refused), and then its --overwrite was refused too."""
    (tmp_path / "a.txt").write_text("some text to train on. " * 300)
    prepare_data([str(tmp_path / "a.txt")], tmp_path / "ds", "byte", stream=io.StringIO())
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "ds"), "--seq-len", "16", "--batch-size", "2",
                 "--steps", "1", "--out", str(tmp_path / "ds"), "--quiet"]) == 2
    assert "(--out): the --data folder the run reads" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before
