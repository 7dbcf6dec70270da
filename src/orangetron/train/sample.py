"""`orangetron sample`: text from a run's latest checkpoint, generated on one rank in this process.

The checkpoint (written on any layout) is read whole, as `orangetron export` reads it (`export.read_model`),
into the reference `Transformer` its record describes, in the dtype of its main parameters; tokens are then
chosen greedily or drawn at a temperature from the top k (`orangetron.model.sampling`), with a key/value
cache (`orangetron.model.decode`) unless `--no-cache`, up to the end of a document (`stop_ids`) unless
`--ignore-eos`. The tokenizer is the one the run records: by name
(`tokenizer.TOKENIZERS`), or the files of a tokenizer folder as the checkpoint keeps them, whatever became of the
folder since (older checkpoints: the folder, if it still encodes as the run did); checkpoints written before they
recorded one used bytes. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orangetron.model import Transformer
    from orangetron.train.export import SavedModel
    from orangetron.train.tokenizer import Tokenizer


def add_sample_command(sub: Any) -> None:
    """Register the `sample` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "sample",
        help="generate text from a run's latest checkpoint",
        description="Continue a prompt with the model of a run's latest checkpoint (written on any layout), "
        "on one rank: greedy by default, or drawn at --temperature from the --top-k most likely tokens. "
        "Prints the prompt and its continuation.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its latest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to generate (default {DEFAULT_NEW_TOKENS}, or as many as the model's max_seq_len "
                        "leaves after the prompt)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default): greedy; > 0: draw from softmax(logits / T)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="draw only among the K most likely tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past an end of document (the tokenizer's EOS, or the ids an imported model's "
                   "generation config ends at) until --max-new-tokens")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence at every step instead of caching keys and values (a check)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: prompt, text, tokens, stop, stop_ids, checkpoint, "
                        "tokenizer_ids, unknown_ids")
    p.set_defaults(run=_run_command)


def _run_command(args: argparse.Namespace) -> int:
    import json

    try:  # a byte the shell passed that is not UTF-8 reaches Python as half a surrogate pair
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"--prompt {args.prompt!r}: is not UTF-8 text (check the terminal's encoding)") from None
    result = sample_run(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed, use_cache=not args.no_cache,
                        stop_at_eos=not args.ignore_eos)
    if args.temperature == 0 and (args.top_k or args.seed):  # after the refusals, which stay one line
        print("orangetron sample: warning: --top-k and --seed have no effect at --temperature 0 (greedy "
              "decoding); give a temperature above 0 to sample", file=sys.stderr)
    ended = f", ended by id {result['tokens'][-1]} (an end of document)" if result["stop"] == "eos" else ""
    print(f"orangetron sample: {len(result['tokens'])} tokens from {result['checkpoint']}{ended}", file=sys.stderr)
    if result["unknown_ids"]:  # the model's vocabulary is wider than its tokenizer's (padding, say)
        print(f"orangetron sample: warning: {result['unknown_ids']} of them are ids the tokenizer does not have "
              f"(it has {result['tokenizer_ids']}): the text leaves them out", file=sys.stderr)
    print(json.dumps(result) if args.json else result["prompt"] + result["text"])
    return 0


# Tokens `sample` generates unless told: fewer where the model's max_seq_len leaves fewer after the prompt (a
# model of 128 positions refused every sample at the default otherwise).
DEFAULT_NEW_TOKENS = 200


def sample_run(run: str | Path, prompt: str, *, max_new_tokens: int | None = None, temperature: float = 0.0,
               top_k: int = 0, seed: int = 0, use_cache: bool = True, stop_at_eos: bool = True,
               tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """Continue `prompt` with the model of `run`'s latest checkpoint (or the checkpoint `run`), ending after an
    end of document (`stop_ids`) when `stop_at_eos`.

    Returns prompt, text (the continuation alone), tokens (its token ids), stop ("eos" when the last token ended
    a document, else "length"), stop_ids (the ids it ends at; none without stop_at_eos), checkpoint (the folder
    read), tokenizer_ids (the tokenizer's vocabulary size) and unknown_ids (how many tokens lie past it: a model's
    vocabulary may be wider, and nothing stops it drawing those ids, as `transformers` would; text leaves them
    out).
    `max_new_tokens` None: DEFAULT_NEW_TOKENS, or as many as the model's max_seq_len leaves after the prompt.
    `tokenizer` None: the one the run records. ValueError for a bad rule or length, FileNotFoundError for a
    missing folder or checkpoint, each in one line, before any token is generated.
    """
    import torch

    from orangetron.model.generate import check_length, generate
    from orangetron.model.sampling import Sampling

    sampling = Sampling(temperature=temperature, top_k=top_k)  # a bad rule stops before the checkpoint is read
    model, saved = load_model(run)
    tokenizer = tokenizer if tokenizer is not None else run_tokenizer(saved.record)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"tokenizer: {tokenizer.vocab_size} token ids, more than the model's vocab_size="
                         f"{model.cfg.vocab_size}")
    prompt_ids = tokenizer.encode(prompt)
    if max_new_tokens is None:
        room = model.cfg.max_seq_len - len(prompt_ids)
        if room < 1:  # blaming --max-new-tokens, which was not given, or continuing with nothing, said neither
            raise ValueError(f"prompt: its {len(prompt_ids)} tokens leave no room for a new one within the model's "
                             f"max_seq_len={model.cfg.max_seq_len}; shorten it")
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
    check_length(model, len(prompt_ids), max_new_tokens)
    ends = stop_ids(saved.record, tokenizer) if stop_at_eos else frozenset()
    out = generate(model, torch.tensor(prompt_ids, dtype=torch.long), max_new_tokens, sampling, seed=seed,
                   use_cache=use_cache, stop_ids=ends)
    tokens = out.tokens.tolist()
    known = [t for t in tokens if t < tokenizer.vocab_size]  # the byte tokenizer refuses others
    return {"prompt": prompt, "text": tokenizer.decode(known), "tokens": tokens,
            "stop": "eos" if tokens and tokens[-1] in ends else "length", "stop_ids": sorted(ends),
            "checkpoint": str(saved.checkpoint), "tokenizer_ids": tokenizer.vocab_size,
            "unknown_ids": len(tokens) - len(known)}


def stop_ids(record: dict[str, Any], tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end a document for a checkpoint's model: its tokenizer's EOS (what prepared datasets put
    between documents) and, for a model imported from a Hugging Face folder, the ids transformers' `generate`
    ends at (`hf.folder.eos_token_ids`). The byte tokenizer has no EOS."""
    from orangetron.hf.folder import eos_token_ids

    ends = frozenset() if tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
    source = record.get("model_source")
    if source and source.get("config"):
        ends |= eos_token_ids(source["config"], source.get("generation_config"))
    return ends


def load_model(run: str | Path) -> tuple[Transformer, SavedModel]:
    """The reference `Transformer` of `run`'s latest checkpoint (the model its record describes), holding the
    saved parameters and router biases in the dtype they were saved in (the run's main parameters)."""
    from orangetron.model import Transformer, model_from_record
    from orangetron.train.export import read_model

    saved = read_model(run)
    model = Transformer(model_from_record(saved.record["model"]),
                        dtype=saved.state_dict["tok_embeddings.weight"].dtype)
    model.load_state_dict(saved.state_dict, strict=True)
    return model, saved


def run_tokenizer(record: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint's record names (`tokenizer.recorded_tokenizer`): the files it keeps, or the
    one at its path, checked; bytes when it names none."""
    from orangetron.train.tokenizer import recorded_tokenizer

    return recorded_tokenizer(record, "sampling")
