"""Sampling: the key/value cache against the plain forward, the decoding rules against plain torch, a trained
run's checkpoint continuing its training text, and `orangetron sample` end to end."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from orangetron.cli import main
from orangetron.model import ModelConfig, Transformer, model_from_record, model_preset
from orangetron.model.decode import KVCache, forward_cached
from orangetron.model.generate import generate
from orangetron.model.sampling import Sampling, next_token, token_probs
from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
from orangetron.train.config import TrainConfig
from orangetron.train.sample import load_model
from orangetron.train.trainer import train

torch.set_num_threads(1)

# Larger weights than the presets' init_std, so that logits spread and a wrong position or key shows.
MODELS = {
    "tiny (GQA)": model_preset("tiny"),
    "tiny-moe (GQA, shared expert)": model_preset("tiny-moe"),
    "dense MHA, tied": ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_dim=64,
                                   tied_embeddings=True, init_std=0.2),
    "moe sigmoid, router bias": ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=1, vocab_size=64, ffn_dim=64,
                                            n_experts=4, top_k=2, moe_ffn_dim=32, moe_layer_freq=2,
                                            router_score="sigmoid", norm_topk_prob=True, router_bias_rate=1e-3,
                                            init_std=0.2),
}
PROMPT = torch.tensor([3, 17, 42, 5, 9, 33, 1])


def _model(name: str) -> Transformer:
    model = Transformer(MODELS[name], seed=7, dtype=torch.float64)
    for layer in model.layers:  # nonzero router biases, so that choosing experts reads them
        router = getattr(layer.feed_forward, "router", None)
        if router is not None and router.expert_bias is not None:
            router.expert_bias.copy_(torch.linspace(-0.05, 0.05, router.n_experts))
    return model


@pytest.mark.parametrize("name", MODELS)
def test_cached_and_uncached_generation_agree(name: str) -> None:
    """Greedy and seeded sampling: the same tokens with and without the cache, every step's logits within
    1e-12 in float64."""
    model = _model(name)
    for sampling in (Sampling(), Sampling(temperature=1.5, top_k=8)):
        cached = generate(model, PROMPT, 24, sampling, seed=5)
        full = generate(model, PROMPT, 24, sampling, seed=5, use_cache=False)
        assert cached.tokens.tolist() == full.tokens.tolist(), sampling
        torch.testing.assert_close(cached.logits, full.logits, rtol=0, atol=1e-12)
        assert cached.tokens.shape == (24,) and cached.logits.shape == (24, model.cfg.vocab_size)


@pytest.mark.parametrize("name", MODELS)
def test_cached_logits_are_the_plain_forwards(name: str) -> None:
    """A batch of two sequences fed to the cache as a prompt, then a token at a time: the logits of every
    position are those of one plain `Transformer.forward` over the whole sequences; and each logits row of
    `generate` is the plain forward's prediction after the tokens before it."""
    model = _model(name)
    seqs = torch.randint(0, model.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    cache = KVCache.for_model(model, batch=2, capacity=19)
    parts = [forward_cached(model, seqs[:, :6], cache)]
    parts += [forward_cached(model, seqs[:, i:i + 1], cache) for i in range(6, 19)]
    with torch.no_grad():
        reference = model(seqs)  # [2, 19, V]
    torch.testing.assert_close(torch.cat(parts, dim=1), reference, rtol=0, atol=1e-12)
    assert cache.length == 19

    out = generate(model, PROMPT, 12, Sampling(temperature=0.8), seed=2)
    whole = torch.cat([PROMPT, out.tokens])
    with torch.no_grad():
        reference = model(whole[None])[0, len(PROMPT) - 1:-1]  # [12, V]: the prediction of each new token
    torch.testing.assert_close(out.logits, reference, rtol=0, atol=1e-12)


def test_generation_leaves_the_model_as_it_was() -> None:
    """No router counts load, no bias or parameter moves, and gradients stay on for the caller."""
    model = _model("moe sigmoid, router bias")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generate(model, PROMPT, 10, Sampling(temperature=1.0), seed=0)
    generate(model, PROMPT, 10, use_cache=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    routers = [layer.feed_forward.router for layer in model.layers if hasattr(layer.feed_forward, "router")]
    assert routers and all(int(r.expert_load.sum()) == 0 for r in routers)
    assert torch.is_grad_enabled()


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    model = _model("tiny-moe (GQA, shared expert)")
    greedy = generate(model, PROMPT, 16).tokens.tolist()
    for temperature in (0.3, 1.0, 20.0):
        assert generate(model, PROMPT, 16, Sampling(temperature, top_k=1), seed=9).tokens.tolist() == greedy


def test_seeded_sampling_is_reproducible_and_the_seed_matters() -> None:
    model = _model("dense MHA, tied")
    rule = Sampling(temperature=2.0)
    first = generate(model, PROMPT, 30, rule, seed=11).tokens.tolist()
    assert generate(model, PROMPT, 30, rule, seed=11).tokens.tolist() == first
    assert generate(model, PROMPT, 30, rule, seed=12).tokens.tolist() != first


def test_top_k_draws_only_among_the_k_most_likely() -> None:
    model = _model("tiny (GQA)")
    out = generate(model, PROMPT, 60, Sampling(temperature=50.0, top_k=3), seed=4)
    for token, logits in zip(out.tokens.tolist(), out.logits, strict=True):
        assert token in torch.topk(logits, 3).indices.tolist()
    assert len(set(out.tokens.tolist())) > 3  # the hot temperature does draw below the top choice


def test_token_probs_are_softmax_of_logits_over_temperature_within_the_top_k() -> None:
    logits = torch.randn(3, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, k in ((0.5, 0), (2.0, 0), (0.7, 5), (1.0, 39)):
        probs = token_probs(logits, Sampling(temperature, k))
        expected = torch.exp(logits / temperature)
        if k:
            kth = logits.sort(dim=-1, descending=True).values[:, k - 1:k]
            expected = torch.where(logits >= kth, expected, 0.0)
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-15)
        assert ((probs > 0).sum(-1) == (k or 40)).all()


def test_a_tiny_temperature_draws_the_most_likely_token() -> None:
    """1e-45 (float32) and 1e-300 (float64) overflowed every logit to +-inf: softmax gave nan and multinomial a
    traceback. They draw the largest logit, splitting a tie evenly."""
    for dtype, temperature in ((torch.float32, 1e-45), (torch.float64, 1e-300)):
        logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 1.0, 3.0]], dtype=dtype)
        probs = token_probs(logits, Sampling(temperature))
        assert probs.tolist() == [[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]
        drawn = next_token(logits[:1].expand(50, 3), Sampling(temperature), torch.Generator().manual_seed(0))
        assert drawn.tolist() == [1] * 50


def test_draws_follow_the_distribution() -> None:
    """4000 draws from logits (0, log 3): the second token about 3/4 of the time (4 sigma: 0.0274)."""
    logits = torch.tensor([[0.0, math.log(3.0)]]).expand(4000, 2)
    drawn = next_token(logits, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    assert abs(drawn.double().mean().item() - 0.75) < 0.0274
    hot = next_token(logits, Sampling(temperature=1e6), torch.Generator().manual_seed(0))
    assert abs(hot.double().mean().item() - 0.5) < 0.0317  # nearly uniform at a huge temperature


@pytest.mark.parametrize("kwargs, message", [(dict(temperature=-0.5), "temperature=-0.5"),
                                             (dict(temperature=float("nan")), "temperature=nan"),
                                             (dict(top_k=-1), "top_k=-1")])
def test_bad_rules_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def test_lengths_past_the_model_are_refused() -> None:
    model = Transformer(ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=32,
                                    max_seq_len=10))
    assert generate(model, PROMPT, 3).tokens.shape == (3,)  # 7 + 3 = 10 fits
    with pytest.raises(ValueError, match="max_seq_len=10"):
        generate(model, PROMPT, 4)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, PROMPT[:0], 4)
    cache = KVCache.for_model(model, batch=1, capacity=8)
    forward_cached(model, PROMPT[None], cache)
    with pytest.raises(ValueError, match="feed the prompt whole"):
        forward_cached(model, PROMPT[None, :2], cache)


# ---- a trained run -----------------------------------------------------------------------------------

SENTENCES = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
             "orangetron trains models on many ranks. ")
TRAINED = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, n_experts=4,
                      top_k=2, moe_ffn_dim=64, router_bias_rate=1e-3, max_seq_len=256, name="sample-test")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> dict:
    """A MoE model with router biases, trained for 60 steps on one rank on a text of three sentences."""
    root = tmp_path_factory.mktemp("sample")
    data = root / "data.txt"
    data.write_text(SENTENCES * 40)
    cfg = TrainConfig(model=TRAINED, data=[str(data)], seq_len=64, batch_size=8, steps=60, warmup=5, lr=1e-2,
                      eval_batches=1, out=str(root / "run"))
    train(cfg, progress=False)
    return {"run": root / "run", "data": data}


def _reference_model(run: Path) -> Transformer:
    """The checkpoint loaded by hand: its recorded model, its parameters and router biases."""
    state = load_checkpoint(latest_checkpoint(run / "checkpoints"), only=("params", "buffers"))
    model = Transformer(model_from_record(state["model"]))
    model.load_state_dict({**state["params"], **state["buffers"]}, strict=True)
    return model


def test_the_trained_model_beats_unigram_bytes_on_its_text(trained_run) -> None:
    """log p(continuation | prefix) of a training sentence: the loaded model's (from the cached forward) is far
    above that of the training file's byte frequencies."""
    model, _ = load_model(trained_run["run"])
    assert torch.equal(model.layers[0].feed_forward.router.expert_bias,
                       _reference_model(trained_run["run"]).layers[0].feed_forward.router.expert_bias)
    prefix, continuation = list(b"the lazy dog. a stitch in"), list(b" time saves nine.")
    tokens = torch.tensor(prefix + continuation)
    cache = KVCache.for_model(model, batch=1, capacity=len(tokens))
    logits = forward_cached(model, tokens[None, :-1], cache)[0, len(prefix) - 1:]  # predicts the continuation
    model_logp = logits.log_softmax(-1).gather(-1, torch.tensor(continuation)[:, None]).sum().item()
    counts = Counter(trained_run["data"].read_bytes())
    total = sum(counts.values())
    unigram_logp = sum(math.log(counts[b] / total) for b in continuation)
    assert model_logp > unigram_logp + 20, (model_logp, unigram_logp)


def _greedy_by_hand(model: Transformer, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq[None])[0, -1].argmax().view(1)])
    return seq[len(prompt):].tolist()


def test_sample_command_continues_the_training_text(trained_run, capsys) -> None:
    run = str(trained_run["run"])
    assert main(["sample", run, "--prompt", "a stitch in", "--max-new-tokens", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["tokens"] == _greedy_by_hand(_reference_model(trained_run["run"]), list(b"a stitch in"), 20)
    assert out["text"] == bytes(out["tokens"]).decode() and out["prompt"] == "a stitch in"
    assert out["checkpoint"].endswith("step-00000060")

    assert main(["sample", run, "--prompt", "a stitch in", "--max-new-tokens", "20", "--no-cache"]) == 0
    assert capsys.readouterr().out == "a stitch in" + out["text"] + "\n"
    hot = ["sample", run, "--prompt", "the", "--max-new-tokens", "30", "--temperature", "3", "--top-k", "4"]
    assert main([*hot, "--seed", "1", "--json"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main([*hot, "--seed", "1", "--json", "--no-cache"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == first


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature=-1.0"),
    (["--top-k", "-2"], "top_k=-2"),
    (["--max-new-tokens", "250"], "max_seq_len=256"),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "ab\udcff"], "--prompt 'ab\\udcff': is not UTF-8 text"),  # a shell's stray byte: a traceback
])
def test_sample_command_refuses_bad_input_in_one_line(trained_run, capsys, argv: list[str], message: str) -> None:
    assert main(["sample", str(trained_run["run"]), "--prompt", "a stitch in", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_the_default_length_stops_where_the_model_does(trained_run, capsys) -> None:
    """Without --max-new-tokens, a prompt and 200 new tokens past the model's max_seq_len was refused: every sample
    of a 128-position model failed unless told a length. The default now generates what the model holds."""
    prompt = SENTENCES[:100]  # 100 byte tokens, with 156 of the 256 positions left
    assert main(["sample", str(trained_run["run"]), "--prompt", prompt, "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 256 - 100
    assert main(["sample", str(trained_run["run"]), "--prompt", "a", "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 200  # the default where the model holds it
    # A prompt that fills the model blamed --max-new-tokens, never given, and one of exactly 256 tokens continued
    # with nothing, exit 0: both now say the prompt leaves no room.
    for length in (256, 300):
        assert main(["sample", str(trained_run["run"]), "--prompt", (SENTENCES * 4)[:length]]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"prompt: its {length} tokens leave no room for a new one within the model's "
                            "max_seq_len=256; shorten it") and len(err.splitlines()) == 1, err


def test_sampling_flags_at_temperature_zero_are_said_to_do_nothing(trained_run, capsys) -> None:
    argv = ["sample", str(trained_run["run"]), "--prompt", "a stitch in", "--max-new-tokens", "3"]
    assert main([*argv, "--top-k", "5"]) == 0
    assert "warning: --top-k and --seed have no effect at --temperature 0" in capsys.readouterr().err
    assert main([*argv, "--top-k", "5", "--temperature", "0.5"]) == 0
    assert "no effect" not in capsys.readouterr().err


def test_sample_command_refuses_missing_runs_in_one_line(tmp_path, capsys) -> None:
    assert main(["sample", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["sample", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no checkpoint under" in err and len(err.splitlines()) == 1


def test_ids_past_the_tokenizer_are_counted_and_left_out_of_the_text(trained_run, capsys, monkeypatch) -> None:
    """A model's vocabulary may be wider than its tokenizer's (padded, say): those ids are still drawn, as
    `transformers` draws them, but the text cannot hold them (bytes refuse them): they are counted and warned of."""
    from orangetron.train import sample
    from orangetron.train.tokenizer import ByteTokenizer

    class Narrow(ByteTokenizer):  # the bytes below "x": the fox, the lazy dog's "y" and "z" lie past it
        vocab_size = 120

    run = str(trained_run["run"])
    assert main(["sample", run, "--prompt", "the quick brown", "--max-new-tokens", "16", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out.splitlines()[-1])
    past = sum(t >= 120 for t in whole["tokens"])
    assert past > 0 and whole["unknown_ids"] == 0 and whole["tokenizer_ids"] == 256
    monkeypatch.setattr(sample, "run_tokenizer", lambda record: Narrow())
    assert main(["sample", run, "--prompt", "the quick brown", "--max-new-tokens", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    narrow = json.loads(out.splitlines()[-1])
    assert narrow["tokens"] == whole["tokens"] and narrow["unknown_ids"] == past
    assert narrow["text"] == bytes(t for t in whole["tokens"] if t < 120).decode()
    assert f"warning: {past} of them are ids the tokenizer does not have (it has 120)" in err


def test_sample_ends_at_the_end_of_a_document_unless_told_not_to(trained_run, capsys, monkeypatch) -> None:
    """A model trained on documents ended by EOS writes EOS and then a new document: `sample` stops after the
    tokenizer's EOS, kept, as transformers' `generate` does; --ignore-eos goes on. Bytes have no EOS."""
    from orangetron.train import sample
    from orangetron.train.tokenizer import ByteTokenizer

    run = str(trained_run["run"])
    free = _greedy_by_hand(_reference_model(trained_run["run"]), list(b"a stitch in"), 20)
    first = next(i for i in range(2, 19) if free[i] not in free[:i])  # a token reached mid-way, first there

    class Ending(ByteTokenizer):
        eos_id = free[first]

    argv = ["sample", run, "--prompt", "a stitch in", "--max-new-tokens", "20", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert plain["tokens"] == free and plain["stop"] == "length" and plain["stop_ids"] == []
    monkeypatch.setattr(sample, "run_tokenizer", lambda record: Ending())
    assert main(argv) == 0
    out, err = capsys.readouterr()
    ended = json.loads(out.splitlines()[-1])
    assert ended["tokens"] == free[:first + 1] and ended["stop"] == "eos" and ended["stop_ids"] == [free[first]]
    assert f"{first + 1} tokens from" in err and f"ended by id {free[first]} (an end of document)" in err
    assert main([*argv, "--ignore-eos"]) == 0
    going_on = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert going_on["tokens"] == free and going_on["stop"] == "length" and going_on["stop_ids"] == []


def test_an_imported_models_generation_settings_end_a_sample_too() -> None:
    """For a run imported from a Hugging Face folder the ids its generation config ends at end a sample beside
    the tokenizer's EOS; generation_config.json, where there is one, wins over config.json, as in transformers."""
    from orangetron.train.sample import stop_ids
    from orangetron.train.tokenizer import ByteTokenizer

    class Ending(ByteTokenizer):
        eos_id = 9

    config, generation = {"eos_token_id": 2}, {"eos_token_id": [5, 7]}
    assert stop_ids({"model_source": {"config": config, "generation_config": generation}}, Ending()) == {5, 7, 9}
    assert stop_ids({"model_source": {"config": config}}, Ending()) == {2, 9}
    assert stop_ids({"model_source": {"config": config, "generation_config": {}}}, ByteTokenizer()) == set()
    assert stop_ids({"model_source": {"config": {"eos_token_id": [3, True]}}}, ByteTokenizer()) == {3}
    assert stop_ids({}, Ending()) == {9} and stop_ids({}, ByteTokenizer()) == set()
