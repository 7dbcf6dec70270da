"""`orangetron export`: a run's latest checkpoint as one plain state dict, or as a Hugging Face folder.

The checkpoint's shards (written on whatever layout the run had) are read whole in this process and saved
with `torch.save` as `{name: tensor}`, the names and shapes of the reference `Transformer`'s `state_dict()`
(parameters and router-bias buffers), so `Transformer(cfg).load_state_dict(torch.load(path,
weights_only=True))` takes it. Parameters come in the dtype the run kept its main parameters in (float32
for a bfloat16 run). The optimizer moments stay behind. torch is imported only when the command runs.

With `--hf`, `-o DIR` becomes a folder `transformers.AutoModelForCausalLM` loads (`orangetron.hf.save`):
config.json with `architectures` (a run started from a Hugging Face folder keeps its source config's other
keys; another names its tokenizer's BOS and EOS, so that `generate` ends where `orangetron sample` does),
model.safetensors by HF names in the source's dtype (else the saved one; `--dtype` chooses), the
run's tokenizer files when it used one (as the checkpoint keeps them: what the run read, whatever its folder
holds now), and the source's generation_config.json as the run recorded it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orangetron.train.outputs import check_claim, claim_output


def add_export_command(sub: Any) -> None:
    """Register the `export` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "export",
        help="write a run's latest checkpoint as one state dict file",
        description="Consolidate a checkpoint (sharded on any layout) into one file holding the model's "
        "state dict, loadable with torch.load(weights_only=True) by the reference Transformer.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its latest checkpoint) or a checkpoint folder")
    p.add_argument("-o", "--output", required=True, metavar="FILE|DIR",
                   help="where to write the state dict (.pt), or with --hf the Hugging Face folder")
    p.add_argument("--hf", action="store_true",
                   help="write a Hugging Face folder (config.json, model.safetensors, the tokenizer's files, the "
                   "source's generation_config.json) that transformers.AutoModelForCausalLM loads")
    p.add_argument("--dtype", choices=("float64", "float32", "bfloat16", "float16"), default=None,
                   help="--hf: the tensors' dtype (default: the imported source's, else the checkpoint's)")
    p.add_argument("--overwrite", action="store_true",
                   help="an -o that exists moves aside to NAME.previous-N (never deleted) instead of refusing")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: checkpoint, output, tensors, bytes (and with --hf, warnings)")
    p.set_defaults(run=_run_command)


def _run_command(args: argparse.Namespace) -> int:
    import json

    if args.hf:
        result = export_hf(args.run_dir, args.output, args.dtype, overwrite=args.overwrite)
    elif args.dtype is not None:
        raise ValueError("--dtype: only with --hf; a state dict keeps the checkpoint's dtype")
    else:
        result = export_model(args.run_dir, args.output, overwrite=args.overwrite)
    if result.get("moved_aside"):
        print(f"orangetron export: moved the former {args.output} to {result['moved_aside']}", file=sys.stderr)
    for warning in result.get("warnings", []):
        print(f"orangetron export: warning: {warning}", file=sys.stderr)
    print(f"orangetron export: wrote {result['output']} ({result['tensors']} tensors, {result['bytes']:,} bytes) "
          f"from {result['checkpoint']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


def find_checkpoint(run: str | Path) -> Path:
    """`run` itself when it is a checkpoint, else the latest checkpoint under `run/checkpoints`."""
    from orangetron.train.checkpoint import MANIFEST_FILE, latest_checkpoint

    run = Path(run)
    if (run / MANIFEST_FILE).is_file():
        return run
    if run.exists() and not run.is_dir():
        raise ValueError(f"RUN_DIR {str(run)!r}: a file; give the run's folder (its --out) or a checkpoint folder")
    if not run.is_dir():
        raise FileNotFoundError(f"RUN_DIR {str(run)!r}: no such folder")
    path = latest_checkpoint(run / "checkpoints")
    if path is None and run.name == "checkpoints":  # the run's checkpoints folder itself
        path = latest_checkpoint(run)
    if path is None and (run / "config.json").is_file():  # what a user given a model folder reaches for
        raise FileNotFoundError(f"RUN_DIR {str(run)!r}: a Hugging Face model folder, not a run (no checkpoint "
                                f"under {run / 'checkpoints'}); `orangetron train --hf-model {run}` trains from it")
    if path is None:
        raise FileNotFoundError(f"RUN_DIR {str(run)!r}: no checkpoint under {run / 'checkpoints'}")
    return path


@dataclass(frozen=True)
class SavedModel:
    """A checkpoint's model, read whole into this process."""

    checkpoint: Path  # the checkpoint folder it came from
    state_dict: dict[str, Any]  # the reference `Transformer`'s state dict: name -> whole tensor
    record: dict[str, Any]  # the checkpoint's JSON values: `model` (its ModelSpec's fields), step, losses ...


def read_model(run: str | Path) -> SavedModel:
    """The model of `run`'s latest checkpoint (or of the checkpoint `run`), whatever layout wrote it:
    parameters and router-bias buffers by the reference `Transformer`'s names, without the optimizer state."""
    from orangetron.train.checkpoint import load_checkpoint

    path = find_checkpoint(run)
    state = load_checkpoint(path, only=("params", "buffers"))
    model = {**state.pop("params"), **state.pop("buffers", {})}
    return SavedModel(path, model, state)


def export_model(run: str | Path, output: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Write the model state dict of `run`'s latest checkpoint to `output` (atomically); returns what was
    written: checkpoint, output, tensors (count), bytes (file size), and where a former `output` moved
    (`overwrite`; without it an existing `output` is refused)."""
    import torch

    output = Path(output).resolve()  # "." and "x/.." named, a link's target written
    if output.is_dir():
        raise ValueError(f"-o {str(output)!r}: is a folder; give a file name")
    saved = read_model(run)
    check_claim(output, "-o", overwrite)  # before the work
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(saved.state_dict, staging)
        moved = claim_output(output, "-o", overwrite)
        os.replace(staging, output)
    finally:
        staging.unlink(missing_ok=True)
    return {"checkpoint": str(saved.checkpoint), "output": str(output), "tensors": len(saved.state_dict),
            "bytes": output.stat().st_size, **({"moved_aside": str(moved)} if moved else {})}


def export_hf(run: str | Path, output: str | Path, dtype: str | None = None, overwrite: bool = False
              ) -> dict[str, Any]:
    """Write the model of `run`'s latest checkpoint as a Hugging Face folder `output`; returns what was written:
    checkpoint, output, tensors (count), bytes (the safetensors file's size), and where a former `output` moved
    (`overwrite`; without it an existing, non-empty `output` is refused). Never into the folder the run was
    imported from or its tokenizer's."""
    import torch

    from orangetron.hf import save
    from orangetron.model import model_from_record
    from orangetron.spec.hf_config import HFConfigError
    from orangetron.train.tokenizer import recorded_tokenizer

    if Path(output).suffix in (".safetensors", ".json", ".bin", ".pt") and not Path(output).is_dir():
        raise ValueError(f"-o {str(output)!r}: --hf writes a folder (config.json, model.safetensors and the "
                         "tokenizer), not a file; give the folder's name")
    output = Path(output).resolve()  # "." and "x/.." named, a link's target written
    saved = read_model(run)
    spec = model_from_record(saved.record["model"])
    source = saved.record.get("model_source")
    dtype = dtype or (source["dtype"] if source else None)
    tokenizer = saved.record.get("tokenizer", "byte")
    tokenizer_path = None if tokenizer == "byte" else Path(tokenizer)
    kept = saved.record.get("tokenizer_files")
    if tokenizer_path is not None and not kept:  # an older checkpoint keeps no files: the path's
        if not tokenizer_path.exists():
            raise FileNotFoundError(f"the run's tokenizer {tokenizer} is gone; its files cannot be copied")
        recorded_tokenizer(saved.record, "exporting")  # refused where it no longer encodes as recorded
    inputs = [("the checkpoint", saved.checkpoint), ("the model the run was imported from", source and source["path"]),
              ("the run's tokenizer", tokenizer_path)]
    check_claim(output, "-o", overwrite, inputs)  # before the work; claimed after it
    staging = output.with_name(f".{output.name}.partial-{uuid.uuid4().hex[:8]}")
    try:  # written whole beside `output` first: a refused config moves nothing aside and leaves nothing behind
        base = source["config"] if source else _token_ids(recorded_tokenizer(saved.record, "exporting"))
        try:
            save(saved.state_dict, staging, spec=spec, dtype=getattr(torch, dtype) if dtype else None,
                 base_config=base, tokenizer=None if kept else tokenizer_path,
                 generation_config=source.get("generation_config") if source else None)
        except HFConfigError as err:  # a field the user may never have set: say whose it is, and what does write
            raise HFConfigError(f"the run's model ({spec.name}) has no Hugging Face form: {err}; `orangetron export "
                                f"{run} -o model.pt` writes its state dict") from None
        for name, text in (kept or {}).items():  # the files the run read, not what the path holds now
            (staging / name).write_text(text, encoding="utf-8")
        moved = claim_output(output, "-o", overwrite, inputs)
        if output.is_dir():
            output.rmdir()  # empty, as claim_output found it
        os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    from safetensors import safe_open

    weights = output / "model.safetensors"
    with safe_open(weights, framework="pt") as f:
        count = len(f.keys())
    return {"checkpoint": str(saved.checkpoint), "output": str(output), "tensors": count,
            "bytes": weights.stat().st_size, **({"moved_aside": str(moved)} if moved else {}),
            "warnings": _tokenizer_warnings(output) + ([BYTE_IDS] if tokenizer == "byte" else [])}


BYTE_IDS = ("the run trained on bytes (the byte tokenizer, which has no files): the folder holds no tokenizer for "
            "transformers to load, and the model's ids are UTF-8 bytes")


def _tokenizer_warnings(output: Path) -> list[str]:
    """What transformers will read differently from the run: a `qwen2` folder gets Qwen2Tokenizer whatever
    tokenizer_config.json names (docs/models.md), and that class splits text by Qwen's own pattern, so a
    tokenizer made for another class gives other ids there."""
    import json

    config = output / "tokenizer_config.json"
    if json.loads((output / "config.json").read_text()).get("model_type") != "qwen2" or not config.is_file():
        return []
    named = json.loads(config.read_text()).get("tokenizer_class") or "none"
    if named.removesuffix("Fast") == "Qwen2Tokenizer":
        return []
    return [f"transformers reads a qwen2 folder's tokenizer as Qwen2Tokenizer, not the {named} this run used: it "
            "splits text by Qwen's pattern, so its ids can differ from the run's (docs/models.md)"]


def _token_ids(tokenizer: Any) -> dict[str, int] | None:
    """config.json's bos_token_id and eos_token_id of a run's own model: its tokenizer's, where it has them."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    return {key: value for key, value in ids.items() if value is not None} or None
