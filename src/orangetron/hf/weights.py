"""Hugging Face tensors <-> the reference `Transformer`'s parameters, by name, one box at a time.

`sources(spec)` maps every parameter of the reference model to where its values lie in a Hugging Face
checkpoint of that model's family:
- `Same`: one HF tensor of the same shape and layout. Hugging Face rotates q and k in the half-split
  ("rotate half") convention, as `model.layers.apply_rope` does, so q_proj and k_proj are copied as they are
  (no interleave permutation); key/value heads keep their order (HF's `repeat_kv` gives query head h key/value
  head h // (heads / kv_heads), as `model.attention` does); SwiGLU's gate (w1) is `gate_proj`, up (w3)
  `up_proj`, down (w2) `down_proj`.
- `Experts`: a stacked expert tensor [E, a, b] (`model.moe.GroupedExperts`, x @ w[e]) from E per-expert
  linear weights [b, a] (Mixtral's `experts.{e}.w1|w2|w3`), transposed.

A box (offsets and sizes in the whole tensor, `parallel.state.Piece`) is read with safetensors' `get_slice`,
which reads those elements only, so a rank reads its own share of the checkpoint (`SafetensorsFolder`
counts the bytes it hands out, per file). Writing goes the other way, whole tensors by HF name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orangetron.hf.folder import INDEX_FILE, SINGLE_FILE
from orangetron.spec.hf_config import hf_family
from orangetron.spec.model import ModelSpec

# Tensors some checkpoints carry that hold no weights (recomputed rotary tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """Safetensors that do not hold the model the config describes; the message names the tensor."""


@dataclass
class SafetensorsFolder:
    """The safetensors of a Hugging Face folder: `model.safetensors`, or the shards that
    `model.safetensors.index.json` lists. `bytes_read` counts, per file name, the bytes of every slice read."""

    path: Path
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor name -> file name
    bytes_read: dict[str, int] = field(default_factory=dict)
    _open: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def open(path: str | Path) -> SafetensorsFolder:
        from safetensors import safe_open

        path = Path(path)
        folder = SafetensorsFolder(path)
        if (path / INDEX_FILE).is_file():
            index = json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))
            folder.weight_map = dict(index["weight_map"])
        elif (path / SINGLE_FILE).is_file():
            with safe_open(path / SINGLE_FILE, framework="pt") as f:
                folder.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        return folder

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise WeightsError(f"{self.path}: holds no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(self.path / file, framework="pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The elements `box` of tensor `name` (one slice per dimension), read from its file alone."""
        values = self._file(name).get_slice(name)[box]
        file = self.weight_map[name]
        self.bytes_read[file] = self.bytes_read.get(file, 0) + values.numel() * values.element_size()
        return values


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


@dataclass(frozen=True)
class Same:
    """The HF tensor `name` is the parameter, element for element."""

    name: str

    def hf_names(self) -> tuple[str, ...]:
        return (self.name,)

    def read(self, folder: SafetensorsFolder, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        return folder.read(self.name, _box(offsets, sizes))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def split(self, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield self.name, tensor


@dataclass(frozen=True)
class Experts:
    """Expert e of the stacked parameter [E, a, b] is the HF linear weight `names[e]` [b, a], transposed."""

    names: tuple[str, ...]

    def hf_names(self) -> tuple[str, ...]:
        return self.names

    def read(self, folder: SafetensorsFolder, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        (e0, a0, b0), (ne, na, nb) = offsets, sizes
        rows = [folder.read(self.names[e], (slice(b0, b0 + nb), slice(a0, a0 + na))).t()
                for e in range(e0, e0 + ne)]  # each [na, nb]
        return torch.stack(rows)  # [ne, na, nb]

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[2], shape[1])

    def split(self, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for name, expert in zip(self.names, tensor, strict=True):
            yield name, expert.t().contiguous()


Source = Same | Experts


def sources(spec: ModelSpec, family: str | None = None) -> dict[str, Source]:
    """Where each parameter of the reference `Transformer(spec)`, and each router's balancing bias (a buffer),
    lies in a Hugging Face checkpoint of `family` (default: `spec.hf_config.hf_family`'s choice), by the
    reference's parameter name."""
    family = hf_family(spec, family)
    out: dict[str, Source] = {"tok_embeddings.weight": Same("model.embed_tokens.weight"),
                              "norm.weight": Same("model.norm.weight")}
    if not spec.tied_embeddings:  # tied: HF keeps the one matrix as the embedding
        out["output.weight"] = Same("lm_head.weight")
    for i in range(spec.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        out[f"{ours}.attention_norm.weight"] = Same(f"{theirs}.input_layernorm.weight")
        out[f"{ours}.ffn_norm.weight"] = Same(f"{theirs}.post_attention_layernorm.weight")
        out |= _attention_sources(spec, f"{ours}.attention", f"{theirs}.self_attn")
        if not spec.is_moe_layer(i):
            out |= _mlp_sources(f"{ours}.feed_forward", f"{theirs}.mlp")
        elif family == "mixtral":
            moe = f"{theirs}.block_sparse_moe"
            out[f"{ours}.feed_forward.router.gate.weight"] = Same(f"{moe}.gate.weight")
            for w in ("w1", "w2", "w3"):  # Mixtral's w1 is the gate, w3 the up projection, w2 the down one
                out[f"{ours}.feed_forward.experts.{w}"] = Experts(
                    tuple(f"{moe}.experts.{e}.{w}.weight" for e in range(spec.num_experts)))
        else:
            out |= _moe_sources(spec, family, f"{ours}.feed_forward", f"{theirs}.mlp")
    return out


def _attention_sources(spec: ModelSpec, ours: str, theirs: str) -> dict[str, Source]:
    out: dict[str, Source] = {}
    for mine, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        out[f"{ours}.{mine}.weight"] = Same(f"{theirs}.{hf}.weight")
        if spec.qkv_bias and mine != "wo":
            out[f"{ours}.{mine}.bias"] = Same(f"{theirs}.{hf}.bias")
    if spec.qk_norm:
        out[f"{ours}.q_norm.weight"] = Same(f"{theirs}.q_norm.weight")
        out[f"{ours}.k_norm.weight"] = Same(f"{theirs}.k_norm.weight")
    return out


def _mlp_sources(ours: str, theirs: str) -> dict[str, Source]:
    """A SwiGLU: w1 is `gate_proj`, w3 `up_proj`, w2 `down_proj`."""
    return {f"{ours}.{mine}.weight": Same(f"{theirs}.{hf}.weight")
            for mine, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}


def _moe_sources(spec: ModelSpec, family: str, ours: str, theirs: str) -> dict[str, Source]:
    """Qwen2-MoE, Qwen3-MoE and Dots1 keep the router as `mlp.gate`, expert e as `mlp.experts.{e}.*_proj`; the
    shared experts are `mlp.shared_expert` (Qwen2-MoE, with `mlp.shared_expert_gate`) or `mlp.shared_experts`
    (Dots1, with the router's balancing bias `mlp.gate.e_score_correction_bias`)."""
    out: dict[str, Source] = {f"{ours}.router.gate.weight": Same(f"{theirs}.gate.weight")}
    for mine, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        out[f"{ours}.experts.{mine}"] = Experts(
            tuple(f"{theirs}.experts.{e}.{hf}.weight" for e in range(spec.num_experts)))
    if family == "qwen2_moe":
        out |= _mlp_sources(f"{ours}.shared_expert", f"{theirs}.shared_expert")
        out[f"{ours}.shared_expert_gate.weight"] = Same(f"{theirs}.shared_expert_gate.weight")
    elif family == "dots1":
        out |= _mlp_sources(f"{ours}.shared_expert", f"{theirs}.shared_experts")
        out[f"{ours}.router.expert_bias"] = Same(f"{theirs}.gate.e_score_correction_bias")
    return out


def check_folder(folder: SafetensorsFolder, spec: ModelSpec, shapes: dict[str, tuple[int, ...]],
                 family: str | None = None) -> None:
    """Refuse, naming the tensor, safetensors that lack a tensor of the model, hold one of another shape, or
    hold a tensor the model has no place for (a bias, a QK-norm weight ...). `shapes`: the whole shape of the
    parameters and buffers about to be read (a pipeline stage's own), by the reference model's names."""
    table = sources(spec, family)
    unmapped = sorted(set(shapes) - set(table))
    if unmapped:
        raise WeightsError(f"{unmapped[0]}: a parameter with no Hugging Face name")
    for name, shape in shapes.items():
        source = table[name]
        expected = source.hf_shape(shape)
        for hf_name in source.hf_names():
            if hf_name not in folder.weight_map:
                raise WeightsError(f"{folder.path}: holds no tensor {hf_name!r} (for {name})")
            if folder.shape(hf_name) != expected:
                raise WeightsError(f"{folder.path}: {hf_name!r} has shape {folder.shape(hf_name)}, the config "
                                   f"makes it {expected}")
    wanted = {hf_name for source in table.values() for hf_name in source.hf_names()}
    extra = sorted(n for n in set(folder.weight_map) - wanted if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise WeightsError(f"{folder.path}: tensor {extra[0]!r} has no place in the model the config describes"
                           + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def hf_tensors(spec: ModelSpec, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
               family: str | None = None) -> dict[str, torch.Tensor]:
    """The reference model's whole tensors (`state_dict`, by its names) as HF tensors by HF name, contiguous,
    cast to `dtype` when given. A router's balancing bias goes where the family keeps one (Dots1's correction
    bias; zeros for a model without it); the other families have no place for it."""
    out = {}
    for name, source in sources(spec, family).items():
        whole = state_dict.get(name)
        if whole is None and name.endswith(".router.expert_bias"):
            whole = torch.zeros(spec.num_experts, dtype=state_dict["tok_embeddings.weight"].dtype)
        for hf_name, tensor in source.split(whole):
            out[hf_name] = (tensor if dtype is None else tensor.to(dtype)).contiguous()
    return out
