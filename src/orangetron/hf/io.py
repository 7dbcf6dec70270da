"""Reading a Hugging Face folder into the reference model or a rank's shards, and writing one.

`read_into` fills `Shards` (`parallel.state`: boxes of whole tensors, views of a rank's own memory) from the
safetensors, reading each box alone, so a rank reads its share; `load` uses it for a whole one-device model.
`save` writes config.json, model.safetensors (HF names, per-expert tensors, a tied head left to the
embedding as HF does) and the tokenizer's files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from orangetron.hf.folder import GENERATION_FILE
from orangetron.hf.weights import SafetensorsFolder, check_folder, hf_tensors, sources
from orangetron.model import Transformer
from orangetron.parallel.state import Shards
from orangetron.spec.hf_config import CONFIG_FILE, hf_config_of, read_config, spec_from_hf
from orangetron.spec.model import ModelSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}


@torch.no_grad()
def read_into(path: str | Path, spec: ModelSpec, params: dict[str, Shards]) -> SafetensorsFolder:
    """Fill every box of `params` (by the reference model's parameter names) from the Hugging Face folder
    `path`, casting to each box's dtype; returns the folder, whose `bytes_read` counts what was read.
    WeightsError names a missing, misshapen or unplaceable tensor before anything is read."""
    folder = SafetensorsFolder.open(path)
    family = read_config(path).get("model_type")  # the folder's own names, when several families hold the spec
    check_folder(folder, spec, {name: shards.shape for name, shards in params.items()}, family)
    table = sources(spec, family)
    for name, shards in params.items():
        for piece in shards.pieces:
            piece.data.copy_(table[name].read(folder, piece.offsets, piece.sizes))
    return folder


def load(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
         ) -> Transformer:
    """The reference `Transformer` of the Hugging Face folder `path`, holding its weights in `dtype`."""
    path = Path(path)
    spec = spec_from_hf(read_config(path), path.resolve().name)
    model = Transformer(spec, dtype=dtype, device=device)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # buffers: routers' biases
    read_into(path, spec, {name: Shards.whole(t.data) for name, t in tensors.items()})
    return model


def save(model: Transformer | dict[str, torch.Tensor], folder: str | Path, *, spec: ModelSpec | None = None,
         dtype: torch.dtype | None = None, base_config: dict[str, Any] | None = None,
         tokenizer: str | Path | None = None, generation_config: dict[str, Any] | None = None) -> Path:
    """Write `model` (a reference `Transformer`, or its whole state dict with `spec`) as a Hugging Face folder:
    config.json (`spec.hf_config.hf_config_of`, keeping `base_config`'s other keys), model.safetensors in
    `dtype` (default: the parameters' own), when `tokenizer` names a folder or tokenizer.json its files, and
    `generation_config` as generation_config.json. HFConfigError names a field no family here holds. Returns the
    folder."""
    if isinstance(model, Transformer):
        spec, state = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    elif spec is None:
        raise ValueError("save: a state dict needs its spec")
    else:
        state = model
    from safetensors.torch import save_file

    family = None if base_config is None else base_config.get("model_type")
    tensors = hf_tensors(spec, state, dtype, family)
    written = next(iter(tensors.values())).dtype
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config_of(spec, DTYPE_NAMES[written], base_config)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    weights = folder / "model.safetensors"
    save_file({k: v.cpu() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    weights.chmod((folder / CONFIG_FILE).stat().st_mode & 0o777)  # safetensors makes it owner-only (0600)
    if tokenizer is not None:
        copy_tokenizer(tokenizer, folder)
    if generation_config is not None:
        (folder / GENERATION_FILE).write_text(json.dumps(generation_config, indent=2) + "\n", encoding="utf-8")
    return folder


def copy_tokenizer(tokenizer: str | Path, folder: Path) -> None:
    """Copy a tokenizer (a folder, or its tokenizer.json) into `folder`: the files transformers reads."""
    source = Path(tokenizer)
    files = [source] if source.is_file() else [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    for file in files:
        shutil.copyfile(file, folder / file.name)

