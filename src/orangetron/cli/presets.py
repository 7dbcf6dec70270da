"""`orangetron presets`: the models `train` builds, the models the planner prices and the GPUs it knows."""

from __future__ import annotations

import argparse
import json
from typing import Any

from orangetron.spec.hardware import gpu_names, load_gpu
from orangetron.spec.model import DualEncoderSpec, load_model, preset_names


def add_presets_command(sub: Any) -> None:
    p = sub.add_parser("presets", help="list model and GPU presets",
                       description="The models `train` and `verify` build (--model), the models `estimate` and "
                                   "`plan` price (--model) and the GPUs they know (--gpu), with their sizes.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=run_presets)


def presets() -> dict[str, list[dict[str, Any]]]:
    """Every preset with the numbers that tell them apart."""
    from orangetron.model.config import MODEL_PRESETS

    train = [{"name": name, "params": spec.total_params(), "layers": spec.num_layers, "hidden": spec.hidden_size,
              "experts": spec.num_experts} for name, spec in MODEL_PRESETS.items()]
    planned = []
    for name in preset_names():
        spec = load_model(name)
        if isinstance(spec, DualEncoderSpec):
            planned.append({"name": name, "params": spec.total_params(), "kind": "dual encoder (DistMM)"})
        else:
            planned.append({"name": name, "params": spec.total_params(), "active_params": spec.active_params(),
                            "layers": spec.num_layers, "hidden": spec.hidden_size, "experts": spec.num_experts,
                            "kind": "moe" if spec.is_moe else "dense"})
    gpus = []
    for name in gpu_names():
        gpu = load_gpu(name)
        gpus.append({"name": name, "bf16_tflops": gpu.bf16_tflops, "fp8_tflops": gpu.fp8_tflops,
                     "memory_gib": gpu.memory_gib, "gpus_per_node": gpu.gpus_per_node, "nic_gbps": gpu.nic_gbps})
    return {"train_models": train, "plan_models": planned, "gpus": gpus}


def run_presets(args: argparse.Namespace) -> int:
    table = presets()
    if args.json:
        print(json.dumps(table))
        return 0
    print("train / verify --model:")
    for m in table["train_models"]:
        moe = f", {m['experts']} experts" if m["experts"] else ""
        print(f"  {m['name']:<16} {m['params'] / 1e6:8.2f}M params, {m['layers']} layers, hidden {m['hidden']}{moe}")
    print("estimate / plan --model:")
    for m in table["plan_models"]:
        active = f" ({count_params(m['active_params'])} active)" if m.get("kind") == "moe" else ""
        print(f"  {m['name']:<16} {count_params(m['params']):>9} params{active}, {m['kind']}")
    print("estimate / plan --gpu:")
    for g in table["gpus"]:
        fp8 = f", fp8 {g['fp8_tflops']:g}" if g["fp8_tflops"] else ""
        print(f"  {g['name']:<16} bf16 {g['bf16_tflops']:g} TFLOP/s{fp8}, {g['memory_gib']:g} GiB, "
              f"{g['gpus_per_node']} per node, NIC {g['nic_gbps']:g} Gbit/s")
    return 0


def count_params(params: int) -> str:
    """A parameter count in billions, or in millions below one billion (tiny presets would print 0.0B)."""
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
