"""A plan's configuration as a run's config file, and a run's config file as `estimate`'s options.

`plan --emit-config FILE` writes the fastest ranked configuration the trainer runs as TOML in the run
folder's `config.toml` schema (`train/run_folder.py`): options by flag name and the model as a `[model]`
table, so `train --config FILE` starts that run and `estimate --config FILE` prices it again. Only what the
runtime runs goes in: a row the trainer refuses (FP8, a planner-only dispatcher, schedule or kernel, folded
experts) is passed over, and the file names the rank of the row it holds.

The trainer computes the global gradient norm every step (it reports it, clips by it, and stops on a
non-finite one), which `plan` leaves out of its ranking: `estimate --config` prices it, so its figures are
the trainer's to the byte, and the plan's row differs only by the norm's all-reduces (4 or 8 bytes per group).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import re
from pathlib import Path
from typing import Any, NoReturn

from orangetron.plan.estimate import Estimate
from orangetron.spec.hardware import gpu_names, load_gpu
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.parallel_config import ParallelConfig, values_of
from orangetron.spec.stages import chunk_layers
from orangetron.train.outputs import check_writable, move_aside

# How the trainer overlaps the expert all-to-all, as the planner's switches price it. It pairs no micro-batches
# (its overlap, `ep_overlap_chunks`, stays within one). Its shared experts run while the forward combine travels
# (`parallel/expert/dispatcher.py`), one of the layer's four transfers: the window with the switch on counts the
# shared experts' backward against all four, so off is the nearer price (it hides nothing).
TRAINER_OVERLAPS = {"overlap_ep": False, "overlap_shared_experts": False}


def trainer_overlaps(asked: dict[str, bool]) -> dict[str, bool]:
    """The expert overlaps `asked` (by `Job` field), each kept only where the trainer runs it."""
    return {name: on and TRAINER_OVERLAPS[name] for name, on in asked.items()}


# Job fields the runtime has no option for: the runtime runs only these values.
_RUNTIME_RUNS = {"fp8": False, "attention_kernel": "flash", "grad_accumulation_fusion": False, "pipeline_layout": (),
                 "optimizer_state_dtype": None, "tp_sum_with_reduction": False, "accumulate_in_reduce_dtype": False,
                 "eager_fp32_loss": False, "recompute_modules": (), "fp8_cached_activations": False,
                 "tp_comm_overlap": False,
                 **TRAINER_OVERLAPS}
# Options of a run's config file that say nothing about the step `estimate` prices but through its documents
# (`pack_documents` and the data: `packed_documents`).
_RUN_ONLY = ("steps", "schedule_steps", "lr", "warmup", "min_lr", "weight_decay", "grad_clip", "seed", "eval_every",
             "eval_batches", "eval_fraction", "data", "corpus_bytes", "out", "save_every", "resume", "extend",
             "stop_after", "overwrite", "new_data", "threads", "timeout_s", "device", "deterministic", "data_record",
             "dtype", "hf_model", "tokenizer", "model_source", "pack_documents")


def train_options(row: Estimate) -> dict[str, Any]:
    """The `train` options (by field name) of a ranked configuration: its layout, parallel options, sequence
    length (the one asked, where cp pads it: the trainer pads it again), global batch and micro-batches."""
    deg, job = row.degrees, row.job
    options = {"seq_len": job.data_tokens, "batch_size": job.micro_batch * deg.dp * job.replica_microbatches(deg),
               "tp": deg.tp, "cp": deg.cp, "pp": deg.pp, "dp": deg.dp, "ep": deg.ep,
               "etp": deg.etp, "expert_fold": deg.expert_fold, **values_of(ParallelConfig, job)}
    options["microbatches"] = job.replica_microbatches(deg)
    return options


def _refusal(row: Estimate) -> str | None:
    """Why the trainer would not run `row` (or not at the time it was priced for), in one line, or None."""
    from orangetron.train.config import TrainConfig

    for name, runs in _RUNTIME_RUNS.items():
        if name in TRAINER_OVERLAPS and not row.model.num_experts:
            continue  # no expert all-to-all: the switch prices nothing
        value = getattr(row.job, name)
        if name == "pipeline_layout" and value:
            if value != _even_split(row.model.num_layers, len(value)):
                return f"pipeline_layout={list(value)}: the trainer runs only the even split of the layers"
        elif value != runs:
            flag = _planner_flag(name)
            how = (f" (drop {flag})" if runs is False else f" (leave {flag} out)") if flag else ""
            return f"{name}={value!r}: the trainer runs {runs!r} only{how}"
    try:
        TrainConfig(model=row.model, **train_options(row))
    except ValueError as err:
        return str(err)
    return None


@functools.cache
def _planner_flag(name: str) -> str | None:
    """The flag of `plan` that sets the planner-only option `name` (`--fp8`), if `plan` has one (`estimate` has
    more: `--tp-comm-overlap`)."""
    import argparse

    from orangetron.cli.plan import add_plan_commands
    from orangetron.train.config_file import planner_flags

    commands = argparse.ArgumentParser().add_subparsers()
    add_plan_commands(commands)
    plan_flags = {flag for action in commands.choices["plan"]._actions for flag in action.option_strings}
    found = planner_flags().get(name)
    return found if found in plan_flags else None


def _even_split(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Layers per virtual stage of the split the trainer runs: a given layout equal to it runs as it."""
    return tuple(len(layers) for layers in chunk_layers(num_layers, chunks, ()))


EMITTED = "# `orangetron plan`'s configuration #"  # how an emitted file begins: another plan may replace it
UNEDITED = "# plan replaces this file while the lines below hash to sha256 "  # the header's last line


def _body_sha256(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _unedited(text: str) -> bool:
    """Whether an emitted file's lines below its header are still what `plan` wrote."""
    header, _, body = text.partition(UNEDITED)
    digest, _, body = body.partition("\n")
    return header.startswith(EMITTED) and digest == _body_sha256(body)


def check_emit_path(path: str, overwrite: bool = False) -> None:
    """Refuse an --emit-config `path` whose folder is missing, or which holds a file `plan` did not write (or
    wrote and someone edited) unless `overwrite`, which moves that file aside when the new one is written."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"--emit-config {path}: no such folder {str(target.parent)!r}")
    if target.is_dir():
        raise ValueError(f"--emit-config {path}: is a folder; give a file name")
    check_writable(target, "--emit-config")
    if target.exists() and not overwrite:
        text = target.read_text(encoding="utf-8", errors="replace")
        if not text.startswith(EMITTED):
            raise ValueError(f"--emit-config {path}: exists and is not a configuration `plan` wrote; give "
                             "another name, or add --overwrite to move it aside")
        if UNEDITED not in text:
            raise ValueError(f"--emit-config {path}: written by an older `plan`, whose files carry no hash of their "
                             "lines to tell an edit by; give another name, or add --overwrite to move it aside")
        if not _unedited(text):
            raise ValueError(f"--emit-config {path}: was edited since `plan` wrote it; give another name, or add "
                             "--overwrite to move it aside")


def emit_config(ranked: list[Estimate], path: str, overwrite: bool = False,
                moved: list[Path] | None = None, hf_model: str | None = None) -> tuple[int, list[str]]:
    """Write the first row of `ranked` the trainer runs to `path`; (its 1-based rank, why earlier rows were
    passed over). ValueError when no row runs, or when `path` may not be written (`check_emit_path`). A file
    `plan` wrote and nobody edited is replaced; with `overwrite` any other moves aside first, and `moved`, when
    given, gets where. `hf_model`: the Hugging Face folder the model was read from, which the file names so
    that the run starts from its weights and tokenizer (the `[model]` table alone would train its shape from
    seeded values on the byte tokenizer). A row priced padded under cp keeps the length asked, which the trainer
    pads again."""
    check_emit_path(path, overwrite)
    passed_over: dict[str, list[int]] = {}  # each reason once, with the ranks it turned away
    for rank, row in enumerate(ranked, start=1):
        reason = _refusal(row)
        if reason is None:
            target = Path(path)
            if target.exists() and not _unedited(target.read_text(encoding="utf-8", errors="replace")):
                aside = move_aside(target)
                if moved is not None:
                    moved.append(aside)
            _write(row, rank, target, hf_model)
            return rank, _by_reason(passed_over)
        passed_over.setdefault(reason, []).append(rank)
    raise ValueError(f"--emit-config {path}: the trainer runs none of the {len(ranked)} ranked configurations ("
                     + "; ".join(_by_reason(passed_over)) + ")")


def trainer_runs(row: Estimate) -> bool:
    """Whether the trainer runs `row` as it was priced (`emit_config` writes the first such row)."""
    return _refusal(row) is None


def _by_reason(passed_over: dict[str, list[int]]) -> list[str]:
    return [_rank_runs(ranks) + f": {reason}" for reason, ranks in passed_over.items()]


def _rank_runs(ranks: list[int]) -> str:
    """Ascending ranks as "#1-#4, #7": a deep ranking passes over many rows for one reason."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"#{run[0]}" + (f"-#{run[-1]}" if len(run) > 1 else "") for run in runs)


def _write(row: Estimate, rank: int, path: Path, hf_model: str | None) -> None:
    from orangetron.train.config import TrainConfig
    from orangetron.train.config_file import write_resolved_config
    from orangetron.train.run_folder import DIRECTIVES

    # options(): the flags' keys, as a record has them (with `hf_model`, the folder's tokenizer when it has one)
    cfg = TrainConfig(model=row.model, hf_model=hf_model, **train_options(row))
    # The device is the training machine's to choose (its default: cuda where torch sees a GPU), not the one
    # this plan was made on; packing is the data's (on for a prepared dataset, which the plan has none of).
    options = {k: v for k, v in cfg.options().items() if k not in (*DIRECTIVES, "model", "device", "pack_documents")}
    write_resolved_config(path, options, {"model": dataclasses.asdict(row.model)})
    gpu = row.cluster.gpu.name
    # A GPU read from a file may share a preset's name (a copy with another NIC, say): only a preset is named bare,
    # so that `estimate --config` prices on it (`planned_gpu`) and refuses any other.
    preset = gpu in gpu_names() and load_gpu(gpu) == row.cluster.gpu
    how = f"as `--gpu {gpu}` gives it" if preset else "give `--gpu` that GPU's file"
    gpu = gpu if preset else f"{gpu} (a GPU file)"
    body = path.read_text(encoding="utf-8").split("\n", 1)[1]
    header = (f"{EMITTED}{rank} ({row.degrees}) for {row.model.name} on {gpu}, as a "
              "run's config file:\n# `orangetron train --config` runs it, `orangetron estimate --config` prices it "
              f"on that GPU (not part of a run's config; {how}).\n{UNEDITED}{_body_sha256(body)}\n")
    path.write_text(header + body, encoding="utf-8")


def planned_gpu(path: str) -> str | None:
    """The GPU `plan` priced a file it wrote for, as its first line names it (`_write`); None for any other
    file (a run folder's config.toml, say)."""
    if Path(path).is_dir():  # a run folder: its config.toml
        return None
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    named = re.fullmatch(re.escape(EMITTED) + r"\d+ \(.*\) for .* on (.+), as a run's config file:\n", first)
    return named.group(1) if named else None


def _refuse_unknown(path: str, key: str, known: list[str]) -> NoReturn:
    from orangetron.train.config_file import RUN_FILE_NAMES, planner_flags

    name = key.replace("-", "_")
    if name in RUN_FILE_NAMES:
        raise ValueError(f"--config {path}: unknown key {key!r}; {RUN_FILE_NAMES[name]}")
    # A run's config file holds what the trainer runs; what only the planner prices comes on the command line.
    flag = planner_flags().get(name)
    if flag:
        raise ValueError(f"--config {path}: unknown key {key!r}: a planner option, which a run's config file does "
                         f"not hold; give it on the command line (`orangetron estimate --config {path} {flag}`)")
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    raise ValueError(f"--config {path}: unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))


def estimate_job(path: str) -> tuple[ModelSpec | str, Degrees, Job]:
    """(model, degrees, job) `estimate` prices for a run's config file (`plan --emit-config`'s, or a run
    folder's config.toml): its layout, parallel options, sequence length, batch and model. The run's own
    options (steps, learning rate, data, ...) say nothing about a step's cost and are skipped; any other key
    is refused by name."""
    from orangetron.train.config import check_batch_split
    from orangetron.train.config_file import checked_value, read_toml, train_keys

    table = read_toml(path)
    layout_fields = {f.name: f for f in dataclasses.fields(Layout)}
    parallel_fields = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    layout, parallel, train_options = {}, {}, train_keys()
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in train_options and not isinstance(value, dict):  # as `train --config` checks it: type, choices
            value = checked_value(path, key, value, train_options[name])
        if name in layout_fields and name in train_options:  # etp and the fold: planner only, on the command line
            layout[name] = _typed(path, key, value, layout_fields[name].default)
        elif name in parallel_fields:
            parallel[name] = _typed(path, key, value, parallel_fields[name].default)
        elif name not in (*_RUN_ONLY, "model", "seq_len", "batch_size"):
            _refuse_unknown(path, key, [*layout_fields, *parallel_fields, *_RUN_ONLY, "model", "seq_len", "batch_size"])
    _check_run_numbers(path, table)
    # A key the file leaves out takes the trainer's default, so that this prices what `train --config` runs;
    # the model of an imported run is its Hugging Face folder.
    trainer, named = _trainer_defaults(), {key.replace("-", "_"): value for key, value in table.items()}
    seq_len, batch = (_typed(path, key, named.get(key, trainer[key]), 0) for key in ("seq_len", "batch_size"))
    model = named.get("model", named.get("hf_model", trainer["model"]))
    deg = Degrees(**layout)
    # The trainer's parallel defaults, not the planner's (Job prices bfloat16 where the trainer runs float32).
    parallel = {name: getattr(ParallelConfig(), name) for name in parallel_fields} | parallel
    microbatches = parallel["microbatches"]
    check_batch_split(batch, deg.dp, microbatches)  # as train refuses it: a rounded micro-batch prices another run
    job = Job(**parallel, seq_len=seq_len, micro_batch=max(1, batch // (deg.dp * microbatches)),
              global_batch=batch, clip_grad=True)  # the trainer's global gradient norm, every step
    return _model(path, model), deg, job


def packed_documents(path: str, limit: int) -> tuple[tuple[int, ...], str] | None:
    """The lengths, in tokens, of the training split's documents a run's file packs, as `train` packs them (the
    first `limit` of them), and a phrase naming them; no lengths, and why, where the run may pack documents this
    machine does not hold; None where the run does not pack documents, or packs text with a tokenizer other than
    bytes (which `train` refuses)."""
    from orangetron.train.config import TrainConfig
    from orangetron.train.config_file import read_toml
    from orangetron.train.corpus import read_text_documents, stdlib_documents
    from orangetron.train.datasets import PreparedDataset, is_prepared_dataset

    table = {key.replace("-", "_"): value for key, value in read_toml(path).items()}  # as train --config reads it
    data = table.get("data")
    data = [data] if isinstance(data, str) else data
    missing = [name for name in data or () if not Path(name).exists()]
    if missing:  # a prepared dataset would pack by default, text files only when asked
        packs = {True: "packs documents", None: "may pack documents (a prepared dataset does)"}
        pack = table.get("pack_documents")
        return None if pack is False else ((), f"the run {packs[pack]}, but its data {missing[0]} is not here")
    prepared = data[0] if data and len(data) == 1 and is_prepared_dataset(data[0]) else None
    if not table.get("pack_documents", prepared is not None):
        return None
    fraction = table.get("eval_fraction", TrainConfig.eval_fraction)
    if prepared is not None:
        dataset = PreparedDataset.open(prepared)
        lengths = dataset.document_lengths(len(dataset) - int(len(dataset) * fraction)).tolist()
        where = f"the prepared dataset {prepared}"
    elif _run_tokenizer(table) != "byte":
        return None
    else:  # one document a text file or a JSON Lines record, its bytes (and the separator after it) its tokens
        texts = read_text_documents(data) if data else stdlib_documents(table.get("corpus_bytes",
                                                                                  TrainConfig.corpus_bytes))
        lengths = _head([len(text.encode("utf-8")) for text in texts], fraction)
        where = "the run's text files" if data else "the standard library's sources"
    count = f"{len(lengths):,}" if len(lengths) <= limit else f"first {limit:,} of {len(lengths):,}"
    return tuple(lengths[:limit]), f"the {count} training documents of {where}"


def _run_tokenizer(table: dict[str, Any]) -> str:
    """The tokenizer a run of text files uses, as train settles it (train/config.py, `_resolve_tokenizer`):
    the one given, else its Hugging Face folder's tokenizer.json, else bytes."""
    folder = table.get("hf_model")
    own = str(folder) if folder and (Path(folder) / "tokenizer.json").is_file() else "byte"
    return table.get("tokenizer") or own


def _head(lengths: list[int], fraction: float) -> list[int]:
    """The lengths of a stream's documents before the last int(total * fraction) tokens, held out."""
    left = sum(lengths) - int(sum(lengths) * fraction)
    kept = []
    for length in lengths:
        if left <= 0:
            break
        kept.append(min(length, left))
        left -= length
    return kept


def _check_run_numbers(path: str, table: dict[str, Any]) -> None:
    """The file's counts and rates in range as `train --config` refuses them (`steps = -5`), the trainer's
    defaults standing in for the keys it leaves out."""
    from orangetron.train.config import TrainConfig, TrainConfigError, check_numbers, floor_min_lr

    values = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | {"min_lr": None}  # as train: none given
    values |= {key.replace("-", "_"): value for key, value in table.items() if not isinstance(value, dict)}
    floor_min_lr(values)
    try:
        check_numbers(values)
    except TrainConfigError as err:
        raise ValueError(f"--config {path}: {err}") from None


def _trainer_defaults() -> dict[str, Any]:
    from orangetron.train.config import TrainConfig

    return {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in ("model", "seq_len", "batch_size")}


def _typed(path: str, key: str, value: Any, default: Any) -> Any:
    """`value` when it has the type of the option's default (a switch, a count, a number), as `train --config`
    checks it."""
    from orangetron.spec.toml_values import check_scalar

    if isinstance(default, (bool, int, float)):
        check_scalar(f"--config {path}: {key} = {value!r}", value, type(default))
    return value


def _model(path: str, value: Any) -> ModelSpec | str:
    """A `[model]` table as its spec; a name or file path as given (`estimate --model` takes those)."""
    if not isinstance(value, dict):
        return value
    from orangetron.train.config import TrainConfig
    from orangetron.train.config_file import check_no_run_options, model_table

    check_no_run_options(path, value, TrainConfig.__dataclass_fields__)
    return model_table(path, value)  # as `train --config` reads it, its refusals worded alike
