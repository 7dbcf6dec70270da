"""`--config FILE`: a TOML file of `train` / `verify` options, the command line overriding it.

Keys are the flags' names without the leading dashes, with dashes or underscores (`zero-stage` or
`zero_stage`); an unknown key is refused naming the closest valid one. Values keep their TOML types and are
checked against the flag: a number where the flag takes one, one of the flag's choices, true/false for a
switch, a list of strings or one string for `data`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orangetron.spec.toml_values import check_scalar

if TYPE_CHECKING:
    from orangetron.spec.model import ModelSpec

_NOT_IN_A_FILE = ("help", "config")
# What a run folder's config.toml records beside the options; not options.
RECORD_TABLES = ("data_record", "model_source")


def config_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option the file may set, by its key (the long flag's name with underscores)."""
    keys = {}
    for action in parser._actions:  # argparse has no public accessor for its options
        # A --no-X flag of an on/off option is the same key with false, not a key of its own.
        negations = isinstance(action, argparse.BooleanOptionalAction)
        long_flags = [s for s in action.option_strings if s.startswith("--")
                      and not (negations and s.startswith("--no-"))]
        for flag in long_flags:
            key = flag[2:].replace("-", "_")
            if key not in _NOT_IN_A_FILE:
                keys[key] = action
    return keys


def read_toml(path: str) -> dict[str, Any]:
    """The TOML file given to --config (a run folder: its config.toml), parsed; FileNotFoundError or ValueError
    naming it in one line."""
    file = Path(path)
    if file.is_dir() and (file / "config.toml").is_file():
        file = file / "config.toml"
    if file.is_dir():
        raise FileNotFoundError(f"--config {path}: a folder without a run's config.toml")
    if not file.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path}: not a TOML file ({err})") from None


def read_config_file(path: str, parser: argparse.ArgumentParser, ignored: Collection[str] = ()) -> dict[str, Any]:
    """The file's options as `parser` defaults (by destination); ValueError naming the file and the key. Keys in
    `ignored` are passed over (`verify` reads a run's file and leaves out what only a training run takes)."""
    table = read_toml(path)
    keys = config_keys(parser)
    defaults = {}
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        if key in RECORD_TABLES or key in ignored:
            continue
        if key == "model" and isinstance(value, dict):  # every field of the model, as a model file has them
            check_no_run_options(path, value, keys)
            defaults["model"] = model_table(path, value)
            continue
        if key == "overwrite" and value is True and key in keys:  # a file used again would move a run aside on
            # every use (false, as a file of every option holds it, is harmless)
            raise ValueError(f"--config {path}: overwrite: moves the run in --out aside, so it is given on the "
                             "command line, for one invocation, never kept in a file")
        if key not in keys and isinstance(value, dict):
            raise ValueError(f"--config {path}: unknown table [{raw_key}]; options go at the top of the file")
        if key not in keys:
            raise ValueError(f"--config {path}: unknown key {raw_key!r}{_unknown_key_hint(key, keys)}")
        action = keys[key]
        defaults[action.dest] = checked_value(path, raw_key, value, action)
    return defaults


# The planner's names for what a run's file holds under other names: what the file calls it, as a refusal says.
RUN_FILE_NAMES = {
    "global_batch": "a run's file gives the samples per step as 'batch_size'",
    "micro_batch": "a run's file gives the micro-batches per step as 'microbatches' (each batch_size / (dp x "
                   "microbatches) samples)",
    "gpu": "a run's file names no GPU: train runs on the devices it finds, and `orangetron estimate --config FILE "
           "--gpu NAME` prices one",
    "gpus": "a run's file gives its GPUs as the layout, tp x cp x pp x dp",
}


def _unknown_key_hint(key: str, keys: dict[str, argparse.Action]) -> str:
    """Why `key` is refused: a planner name for a key the file names otherwise, an option only the planner prices
    (its flag named), else the closest valid key."""
    if key in RUN_FILE_NAMES:
        return f"; {RUN_FILE_NAMES[key]}"
    planner_flag = planner_flags().get(key)
    if planner_flag:
        return f": a planner option (`orangetron estimate {planner_flag}`), which the trainer does not run"
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(keys))}"


def planner_flags() -> dict[str, str]:
    """`estimate`'s flag for each field of the planner's job that is not one of the trainer's options, by key
    (`RUN_FILE_NAMES`' keys among them)."""
    from orangetron.cli.plan import add_plan_commands
    from orangetron.spec.options import Job
    from orangetron.spec.parallel_config import ParallelConfig

    commands = argparse.ArgumentParser().add_subparsers()
    add_plan_commands(commands)
    flags = {key: action.option_strings[0] for key, action in config_keys(commands.choices["estimate"]).items()}
    planner_only = {f.name for f in dataclasses.fields(Job)} - {f.name for f in dataclasses.fields(ParallelConfig)}
    planner_only |= {"etp", "edp"}  # the expert mesh beyond ep, which the runtime does not build
    return {key: flags[key] for key in planner_only if key in flags}


def train_keys() -> dict[str, argparse.Action]:
    """`train`'s option for each key its config file may hold (`estimate --config` checks a value as `train`
    does, by `checked_value`)."""
    from orangetron.train.commands import add_train_commands

    commands = argparse.ArgumentParser().add_subparsers()
    add_train_commands(commands)
    return config_keys(commands.choices["train"])


def check_no_run_options(path: str, table: dict[str, Any], keys: Collection[str]) -> None:
    """A run option inside [model] was written below the table (a line appended to an emitted config lands there):
    say where it belongs rather than that the model has no such field."""
    from orangetron.spec.model import ModelSpec

    model_fields = {f.name for f in dataclasses.fields(ModelSpec)}
    misplaced = [k for k in table if k.replace("-", "_") in keys and k.replace("-", "_") not in model_fields]
    if misplaced:
        raise ValueError(f"--config {path}: [model] holds {', '.join(misplaced)}, an option of the run: a TOML table "
                         "runs to the next table or the end of the file, so put it above the [model] line")


def model_table(path: str, table: dict[str, Any]) -> ModelSpec:
    """The `[model]` table of the file `path` as its spec; ValueError naming the file and the table."""
    from orangetron.spec.model import ModelSpec, parse_model

    try:
        spec = parse_model(str(table.get("name", Path(path).stem)), table)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--config {path}: [model]: {err}") from None
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"--config {path}: [model] describes a dual encoder; the trainer runs decoders")
    return spec


def checked_value(path: str, key: str, value: Any, action: argparse.Action) -> Any:
    """`value` of `key` in the file `path` as `action` (its option's flag) takes it; ValueError naming both."""
    where = f"--config {path}: {key} = {value!r}"
    if isinstance(value, dict):
        raise ValueError(f"{where}: a table; this key takes a single value")
    if action.nargs == 0:  # a switch (store_true)
        check_scalar(where, value, bool)
        return value
    if action.nargs in ("+", "*"):
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"{where}: must be a string or a list of strings")
        return values
    if action.type in (int, float):
        check_scalar(where, value, action.type)
    if action.type is None and not isinstance(value, str):
        raise ValueError(f"{where}: must be a string")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: must be one of {', '.join(map(str, action.choices))}")
    return float(value) if action.type is float else value


def write_resolved_config(path: Path, options: dict[str, Any], tables: dict[str, dict[str, Any]] | None = None,
                          ) -> None:
    """Write `options` (scalars, strings, lists; None omitted), then each of `tables` as a `[name]` table, as
    TOML that `--config` reads back."""
    lines = ["# The resolved options of this run: `orangetron train --config` on this file repeats it.\n"]
    lines += [f"{key} = {_toml_value(value)}\n" for key, value in options.items() if value is not None]
    for name, table in (tables or {}).items():
        lines.append(f"\n[{name}]\n")
        lines += [f"{key} = {_toml_value(value)}\n" for key, value in table.items() if value is not None]
    path.write_text("".join(lines), encoding="utf-8")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"{value!r}: not a TOML scalar or list")
