"""`train --hf-model` on a layout, against plain torch on one device; export back; tokenizers as transformers has them.

One launch per family: Llama, Qwen2 and Qwen3 on tp2 x dp2 and the MoE families on tp2 x dp2 x ep2, all with
ZeRO-1 (so each rank holds a quarter of the dense main parameters and reads only that from the safetensors), two
AdamW steps in float64 from the Hugging Face folder's weights. The run must match tests/trainer_reference.py (the
unwrapped model holding the same weights, torch.optim.AdamW and torch's clipping) to 1e-9: losses, every step's gradient
norm, the final parameters and both AdamW moments (the first moment after two steps is a sum of the two
steps' gradients). Then every tensor `export --hf` writes equals the checkpoint's, and transformers loads the
export and gives our trained model's logits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402
from trainer_reference import assert_matches_reference, reference_training  # noqa: E402

from orangetron.cli import main  # noqa: E402
from orangetron.hf.weights import hf_tensors  # noqa: E402
from orangetron.model import model_from_record  # noqa: E402
from orangetron.train.config import TrainConfig  # noqa: E402
from orangetron.train.export import export_hf, read_model  # noqa: E402
from orangetron.train.tokenizer import HFTokenizer  # noqa: E402
from orangetron.train.trainer import train  # noqa: E402


def _run_and_compare(tmp_path, folder, **layout):
    hf_models.add_tokenizer(folder)
    text = hf_models.corpus_file(tmp_path / "text")
    cfg = TrainConfig(hf_model=str(folder), data=[str(text)], steps=2, seq_len=16, batch_size=4,
                      param_dtype="float64", warmup=0, lr=3e-3, min_lr=3e-4, eval_batches=2, zero_stage=1,
                      out=str(tmp_path / "run"), **layout)
    result = train(cfg, progress=False)
    one_device = dataclasses.replace(cfg, tp=1, dp=1, ep=1, zero_stage=0, out=None)
    assert_matches_reference(result, tmp_path / "run", reference_training(one_device), rtol=1e-9)
    return cfg, result


def _check_reads(result, folder, ep=1):
    """Each of the 4 ranks read about its share of the checkpoint, not all of it: a quarter of the dense weights
    (halves over tp, ZeRO-1 halves over dp) and 1/ep of the routed experts (whole on each tp rank, one expert
    data-parallel rank)."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (not a dict)
    nbytes = {k: 8 * torch.Size(shape).numel() for k, shape in sizes.items()}
    experts = sum(n for k, n in nbytes.items() if ".experts." in k)
    share = experts / ep + (sum(nbytes.values()) - experts) / 4
    reads = [entry["bytes_read"] for entry in result["imported"]]
    assert len(reads) == 4
    assert all(0.9 * share < r < 1.1 * share for r in reads), (reads, share)
    assert max(reads) < 0.6 * sum(nbytes.values())


def _check_export(tmp_path, cfg, tokenizer=True):
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--hf", "-o", str(out)]) == 0
    saved = read_model(tmp_path / "run")
    spec = model_from_record(saved.record["model"])
    expected = hf_tensors(spec, saved.state_dict)
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) and written[k].dtype == torch.float64 for k in expected)
    # transformers loads the export unchanged and computes our trained model's logits; the tokenizer came along
    from orangetron.train.sample import load_model

    ours, _ = load_model(tmp_path / "run")
    theirs = hf_models.reference(out)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), hf_models.float64_islands(theirs):
        gap = (ours(tokens) - theirs(tokens).logits).abs().max() / theirs(tokens).logits.abs().max()
    assert gap < 1e-10
    # the source's generation config (its token ids for `generate`) came along, as transformers reads it
    source_generation = Path(cfg.hf_model) / "generation_config.json"
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(source_generation.read_text())
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == \
        transformers.GenerationConfig.from_pretrained(cfg.hf_model).eos_token_id
    if not tokenizer:
        return
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto("def f(x):\n    return x")["input_ids"] == HFTokenizer(cfg.tokenizer).encode("def f(x):\n    return x")


def _check_record(tmp_path, folder):
    record = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert record["hf_model"] == str(folder.resolve())
    assert record["tokenizer"] == str(folder.resolve())  # --hf-model picked up the folder's tokenizer
    assert record["data_record"]["tokenizer"] == str(folder.resolve())
    source = record["model_source"]
    assert source["path"] == str(folder.resolve()) and len(source["config_sha256"]) == 64
    assert "config" not in source and "generation_config" not in source  # parsed, in the checkpoints only
    assert source["files"] == [{"name": "model.safetensors", "bytes": (folder / "model.safetensors").stat().st_size}]
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["tokenizer"] == str(folder.resolve()) and state["model_source"]["config"]["model_type"]


def test_llama_trains_on_tp2_dp2_as_on_one_device_and_exports(tmp_path):
    folder = hf_models.llama(tmp_path / "llama")
    cfg, result = _run_and_compare(tmp_path, folder, tp=2, dp=2)
    _check_reads(result, folder)
    _check_record(tmp_path, folder)
    _check_export(tmp_path, cfg)


def test_mixtral_trains_on_tp2_dp2_ep2_as_on_one_device_and_exports(tmp_path):
    folder = hf_models.mixtral(tmp_path / "mixtral")
    cfg, result = _run_and_compare(tmp_path, folder, tp=2, dp=2, ep=2)
    _check_reads(result, folder, ep=2)
    _check_export(tmp_path, cfg)


@pytest.mark.parametrize("build", ["qwen2", "qwen3"])
def test_qwen_trains_on_tp2_dp2_as_on_one_device_and_exports(tmp_path, build):
    """Qwen2's q/k/v biases split over tp with their weights; Qwen3's QK-norm weights, replicated, summed over tp."""
    folder = getattr(hf_models, build)(tmp_path / build)
    cfg, result = _run_and_compare(tmp_path, folder, tp=2, dp=2)
    _check_reads(result, folder)
    # transformers 5 gives a qwen2 folder its Qwen2Tokenizer whatever tokenizer_config.json names, and that class
    # splits the text with Qwen's own pattern, not the byte-level BPE's trained here (docs/models.md)
    _check_export(tmp_path, cfg, tokenizer=build != "qwen2")
    warnings = export_hf(tmp_path / "run", tmp_path / "again")["warnings"]
    assert warnings == ([] if build == "qwen3" else [
        "transformers reads a qwen2 folder's tokenizer as Qwen2Tokenizer, not the PreTrainedTokenizerFast this run "
        "used: it splits text by Qwen's pattern, so its ids can differ from the run's (docs/models.md)"])
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    text = "def f(x):\n    return x"
    assert (auto(text)["input_ids"] == HFTokenizer(cfg.tokenizer).encode(text)) == (build == "qwen3")  # as it warns


def test_a_tied_qwen2_trains_on_pp2_dp2_as_on_one_device_and_exports(tmp_path):
    """A tied checkpoint (Qwen2.5's small sizes): the last stage's head reads its own copy of the embedding,
    read from the folder's one matrix; the checkpoint keeps the first stage's, and the export drops lm_head."""
    folder = hf_models.qwen2(tmp_path / "qwen2", tied=True)
    cfg, _ = _run_and_compare(tmp_path, folder, pp=2, dp=2, microbatches=2)
    _check_export(tmp_path, cfg, tokenizer=False)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "export").tie_word_embeddings


def test_qwen2_moe_trains_on_tp2_dp2_ep2_as_on_one_device_and_exports(tmp_path):
    """q/k/v biases split with their weights over tp, the shared expert's sigmoid gate replicated."""
    folder = hf_models.qwen2_moe(tmp_path / "qwen2_moe")
    cfg, result = _run_and_compare(tmp_path, folder, tp=2, dp=2, ep=2, sequence_parallel=True)
    _check_reads(result, folder, ep=2)
    _check_export(tmp_path, cfg)


def test_qwen3_moe_trains_on_tp2_dp2_ep2_as_on_one_device_and_exports(tmp_path):
    """QK-norm over heads wider than hidden / heads, the weights replicated over tp."""
    folder = hf_models.qwen3_moe(tmp_path / "qwen3_moe")
    cfg, result = _run_and_compare(tmp_path, folder, tp=2, dp=2, ep=2)
    _check_reads(result, folder, ep=2)
    _check_export(tmp_path, cfg)


def test_dots1_trains_on_tp2_dp2_ep2_as_on_one_device_and_exports(tmp_path):
    """Group-limited sigmoid routing scored by top-2 sums, with the checkpoint's correction bias, which moves
    with the training loads, and is written back as `e_score_correction_bias`."""
    folder = hf_models.dots1(tmp_path / "dots1")
    cfg, result = _run_and_compare(tmp_path, folder, tp=2, dp=2, ep=2, sequence_parallel=True)
    _check_reads(result, folder, ep=2)
    _check_export(tmp_path, cfg)
    from safetensors.torch import load_file

    source, written = load_file(folder / "model.safetensors"), load_file(tmp_path / "export" / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert source[bias].abs().min() > 0 and not torch.equal(source[bias], written[bias])  # read, then moved


def test_verify_starts_from_a_hugging_face_folder_and_names_it(tmp_path, capsys):
    """verify --hf-model without --model: its --model default must not count as a second model (it was refused on
    every invocation), and the result names the folder's model."""
    folder = hf_models.llama(tmp_path / "llama")
    assert main(["verify", "--hf-model", str(folder), "--dp", "2", "--zero-stage", "1", "--steps", "1",
                 "--seq-len", "16", "--batch-size", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] and result["hf_model"] == str(folder.resolve()) and result["model"] == "llama"
    assert result["options"] == {"zero_stage": 1} and result["max_grad_rel_diff"] < 1e-12
    assert "model llama, tp=1 cp=1 pp=1 dp=2 ep=1, zero_stage=1, 1 step in float64" in err
    # on a dataset the folder's own tokenizer prepared, packed: verify had no --data, and packing asked for one
    from orangetron.train.prepare import prepare_data

    hf_models.add_tokenizer(folder)
    prepare_data([str(hf_models.corpus_file(tmp_path / "text"))], tmp_path / "ds", str(folder), progress=False)
    assert main(["verify", "--hf-model", str(folder), "--data", str(tmp_path / "ds"), "--cp", "2", "--steps", "1",
                 "--seq-len", "16", "--batch-size", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] and result["pack_documents"] and result["max_grad_rel_diff"] < 1e-12
    assert "model llama, tp=1 cp=2 pp=1 dp=1 ep=1, packed documents, 1 step in float64" in err


def test_export_refuses_the_folder_the_run_was_imported_from(tmp_path, capsys):
    """`export --hf -o` into the source folder replaced its pretrained weights and then crashed copying the
    tokenizer onto itself, and `-o` a folder above it with --overwrite moved the source away; both are refused,
    with --overwrite too, and a second export to one folder needs it."""
    folder = hf_models.llama(tmp_path / "hub" / "llama")
    hf_models.add_tokenizer(folder)
    weights = (folder / "model.safetensors").read_bytes()
    run = tmp_path / "run"
    assert main(["train", "--hf-model", str(folder), "--data", str(hf_models.corpus_file(tmp_path / "text")),
                 "--steps", "1", "--seq-len", "16", "--batch-size", "4", "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    for output, extra in ((folder, []), (folder, ["--overwrite"]), (folder.parent, ["--overwrite"])):
        assert main(["export", str(run), "--hf", "-o", str(output), *extra]) == 2
        assert "holds the model the run was imported from" in capsys.readouterr().err  # the folder, or above it
        assert (folder / "model.safetensors").read_bytes() == weights
    assert main(["export", str(run), "--hf", "-o", str(tmp_path / "out")]) == 0
    assert main(["export", str(run), "--hf", "-o", str(tmp_path / "out")]) == 2
    assert main(["export", str(run), "--hf", "-o", str(tmp_path / "out"), "--overwrite"]) == 0
    assert (tmp_path / "out.previous-1" / "model.safetensors").is_file()
    # a new run into the folder it imports wrote its checkpoints and record among the model's files
    before = sorted(p.name for p in folder.iterdir())
    assert main(["train", "--hf-model", str(folder), "--steps", "1", "--seq-len", "16", "--batch-size", "4",
                 "--out", str(folder), "--quiet"]) == 2
    assert "(--out): the --hf-model folder the run reads" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_given_as_the_architecture_or_without_a_tokenizer_is_warned_of(tmp_path):
    """A Hugging Face folder given to --model trained from random weights on bytes without a word, and one given to
    --hf-model without tokenizer files trained its weights on byte ids: both are named before the run starts."""
    folder = hf_models.llama(tmp_path / "llama")
    as_architecture = TrainConfig(model=str(folder), steps=2, corpus_bytes=60_000).warnings()
    assert any(f"--hf-model {folder} starts from its weights" in w for w in as_architecture)
    without_tokenizer = TrainConfig(hf_model=str(folder), steps=2, corpus_bytes=60_000).warnings()
    assert any("has no tokenizer files" in w for w in without_tokenizer)
    hf_models.add_tokenizer(folder)
    assert TrainConfig(hf_model=str(folder), steps=2, warmup=0, corpus_bytes=60_000).warnings() == []
    from orangetron.train.prepare import prepare_data  # a dataset's tokenizer wins over the folder's, silently

    text = hf_models.corpus_file(tmp_path / "text")
    prepare_data([str(text)], tmp_path / "bytes", "byte", progress=False)
    on_bytes = TrainConfig(hf_model=str(folder), data=[str(tmp_path / "bytes")], steps=2).warnings()
    assert any("its weights train on the ids of the prepared dataset's tokenizer byte, not its own" in w
               for w in on_bytes), on_bytes
    prepare_data([str(text)], tmp_path / "own", str(folder), progress=False)
    assert TrainConfig(hf_model=str(folder), data=[str(tmp_path / "own")], steps=2, warmup=0).warnings() == []
    other = TrainConfig(hf_model=str(folder), tokenizer="byte", steps=2, warmup=0, corpus_bytes=60_000)
    assert other.warnings() == [f"hf_model={str(folder)!r} (--hf-model): its weights train on the ids of "
                                "tokenizer='byte' (--tokenizer), not its own; leave --tokenizer out to train on those"]
    assert TrainConfig(hf_model=str(folder), tokenizer=str(folder), steps=2, warmup=0,
                       corpus_bytes=60_000).warnings() == []  # the folder's own, named
    # A resume trains the checkpoint's weights on its record's tokenizer (a copy `tokenizer export` wrote, after
    # the folder's own was retrained, say): the folder's tokenizer says nothing about them.
    resumed = TrainConfig(hf_model=str(folder), tokenizer="byte", steps=2, warmup=0, corpus_bytes=60_000,
                          out=str(tmp_path / "run"), resume=True)
    assert resumed.warnings() == []
    narrow = hf_models.llama(tmp_path / "narrow", vocab_size=200)
    hf_models.add_tokenizer(narrow)  # 300 ids
    with pytest.raises(ValueError, match=r"\(--hf-model, the folder's\): 300 token ids, more than the model's "
                                         r"vocab_size=200"):  # it blamed --tokenizer, which was not given
        TrainConfig(hf_model=str(narrow), steps=2, corpus_bytes=60_000)
    (folder / "tokenizer.json").write_text("{not json")  # the run does not use it: it warns, it does not stop
    on_bytes = TrainConfig(hf_model=str(folder), data=[str(tmp_path / "bytes")], steps=2).warnings()
    assert any("not its own" in w for w in on_bytes)


def test_a_truncated_weight_file_is_refused_in_one_line_before_any_rank_starts(tmp_path, capsys):
    folder = hf_models.llama(tmp_path / "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # an interrupted copy
    capsys.readouterr()  # transformers' progress bars while the folder was written
    assert main(["train", "--hf-model", str(folder), "--steps", "1", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.safetensors is not a readable safetensors file" in err
    # A path that is not a folder says what it is instead: missing, or the folder's config.json itself.
    for path, why in ((tmp_path / "nope", "no such folder"),
                      (folder / "config.json", f"a file; give the folder that holds it ({folder})")):
        assert main(["train", "--hf-model", str(path), "--steps", "1"]) == 2
        assert f"(--hf-model): {why}" in capsys.readouterr().err


def test_a_resumed_run_needs_no_weights_from_its_source_folder(tmp_path, capsys):
    """A resume reads its checkpoint: it was refused once the source's weights were cut short, and it failed
    describing a folder whose weights were deleted to save space."""
    folder = hf_models.llama(tmp_path / "llama")
    hf_models.add_tokenizer(folder)
    run = ["train", "--hf-model", str(folder), "--steps", "2", "--seq-len", "16", "--batch-size", "4", "--quiet",
           "--out", str(tmp_path / "run")]
    assert main([*run, "--stop-after", "1"]) == 0
    recorded = (tmp_path / "run" / "config.toml").read_text()
    generation = json.loads((folder / "generation_config.json").read_text())
    config, record = folder / "config.json", tmp_path / "run" / "config.toml"
    kept = config.read_text()
    config.write_text(json.dumps(json.loads(kept) | {"rope_theta": 20000.0}))  # a repeat starts from the folder
    capsys.readouterr()
    assert main(["train", "--config", str(record), "--out", str(tmp_path / "again")]) == 2
    assert f"--config {record} repeats a run that started from this folder, whose config.json differs now" in \
        capsys.readouterr().err
    config.write_text(kept)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()
    assert main([*run, "--resume"]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "config.toml").read_text() == recorded  # the source as the run started from it
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / "state.json").read_text())
    assert state["model_source"]["files"][0]["bytes"] == weights.stat().st_size + 100
    moved = tmp_path / "moved"  # the source at another path: the flag is not needed, and said so
    shutil.copytree(folder, moved)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--hf-model", str(moved)]) == 2
    assert "(--hf-model): a resumed run reads no weight from it" in capsys.readouterr().err
    weights.unlink()
    assert main([*run, "--steps", "3", "--extend", "--resume"]) == 0, capsys.readouterr().err
    (folder / "generation_config.json").unlink()  # export writes the generation config the run recorded
    assert main(["export", str(tmp_path / "run"), "--hf", "-o", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == generation


def test_a_folder_whose_eos_id_is_not_its_tokenizers_is_warned_of(tmp_path):
    """transformers' `generate` ends at generation_config.json's eos_token_id (config.json's without one): where
    the tokenizer ends documents with another id, an export would run past a document's end without a word."""
    folder = hf_models.llama(tmp_path / "llama")
    hf_models.add_tokenizer(folder)  # its EOS is id 0, as the folder's configs say
    generation, config = folder / "generation_config.json", folder / "config.json"

    def eos_notes() -> list[str]:
        notes = TrainConfig(hf_model=str(folder), steps=1, warmup=0, corpus_bytes=60_000).warnings()
        return [note for note in notes if "eos_token_id" in note]

    assert eos_notes() == []
    for ids, warned in (([2], True), ([2, 0], False), (0, False), (2, True)):
        generation.write_text(json.dumps({"eos_token_id": ids}))
        assert bool(eos_notes()) == warned, ids
    assert "end text at eos_token_id [2], but the tokenizer" in eos_notes()[0] and "with id 0" in eos_notes()[0]
    generation.write_text(json.dumps({"eos_token_id": 0}))
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": 2}))
    assert eos_notes() == []  # the generation config is what generate reads
    generation.unlink()
    assert "eos_token_id [2]" in eos_notes()[0]


def test_a_generation_config_is_recorded_only_when_it_is_a_json_object(tmp_path):
    """Training does not read it, so a missing or broken one stops nothing (a broken one is warned of); export
    then writes none."""
    from orangetron.hf.folder import read_generation_config

    assert read_generation_config(tmp_path) is None
    file = tmp_path / "generation_config.json"
    for text, want in (("{", None), ("[1, 2]", None), ('{"eos_token_id": [2, 3]}', {"eos_token_id": [2, 3]})):
        file.write_text(text)
        assert read_generation_config(tmp_path) == want
    folder = hf_models.llama(tmp_path / "llama")
    hf_models.add_tokenizer(folder)
    assert TrainConfig(hf_model=str(folder), steps=1, warmup=0, corpus_bytes=60_000).warnings() == []
    (folder / "generation_config.json").write_text("{")
    assert any("its generation_config.json is not a JSON object" in w
               for w in TrainConfig(hf_model=str(folder), steps=1, warmup=0, corpus_bytes=60_000).warnings())
    assert main(["train", "--hf-model", str(folder), "--steps", "1", "--seq-len", "16", "--batch-size", "4",
                 "--quiet", "--out", str(tmp_path / "run")]) == 0
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000001" / "state.json").read_text())
    assert "generation_config" not in state["model_source"] and state["model_source"]["config"]
    assert main(["export", str(tmp_path / "run"), "--hf", "-o", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "generation_config.json").exists() and (tmp_path / "out" / "config.json").exists()
