"""A run folder belongs to one run: its record, what `--resume` restores and refuses, and a new run's claim.

The record is the folder's `config.toml`: the run's options by flag name, the model as a `[model]` table
with every field of the schema (`spec/model.py`), the data as a `[data_record]` table: where it came from,
its tokenizer, its size and the SHA-256 of the text the tokenizer read, with each file's path, size and hash
(for a prepared dataset: its folder, token count and the SHA-256 of its dataset.json); and for a run started
from a Hugging Face folder (`--hf-model`) a `[model_source]` table: the folder, the SHA-256 of its
config.json and safetensors index, its files' sizes and its dtype. The
command line restores every option a resumed run does not give from the record (`cli/__init__.py`); this
module then refuses what a resume may not change:
- an option outside `CHANGEABLE_ON_RESUME` that differs from the record, named in one line;
- a tokenizer that encodes other ids than the recorded one (one at another path that encodes the same, a copy
  `tokenizer export` wrote say, is taken), with new data too;
- data whose text differs from the record, unless `new_data` (`--new-data` with `--data`); the change is
  then appended to `changes.jsonl` with the step it took effect at, as every changed option is.

A new run given a run's record as its `--config` repeats that run (`check_repeat`): data, a tokenizer or a
Hugging Face folder that changed since the record was written is refused, unless the command line names it
again. A new run inside another run's folder is refused.

A new run (no `resume`) into a folder that holds another run's record, metrics or checkpoints is refused,
unless `overwrite`: the old run then moves aside to the first free `RUN.previous-N`, never deleted. While a
run runs, its folder is locked: a second `train` into it, new or resumed, is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from orangetron.spec.digest import file_record, file_sha256
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec, parse_model
from orangetron.spec.parallel_config import ParallelConfig
from orangetron.train import folder_lock
from orangetron.train.config import TrainConfig, TrainConfigError, _flag
from orangetron.train.config_file import read_toml, write_resolved_config
from orangetron.train.corpus import read_text_files, stdlib_corpus
from orangetron.train.datasets import DATASET_FILE, DOCUMENTS_FILE, TOKENS_FILE, meta_sha256, read_meta
from orangetron.train.outputs import check_holds_no_input, holds_checkpoints, move_aside

CONFIG_FILE = "config.toml"
CHANGES_FILE = "changes.jsonl"
RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "checkpoints")  # any of them: the folder holds a run
# The source folder's files a run keeps parsed in its checkpoints for export, not in config.toml (`model_source`)
PARSED_FILES = ("config", "generation_config")
# What one invocation says about itself, never restored by the next: write-once directives.
DIRECTIVES = ("out", "resume", "extend", "stop_after", "overwrite", "new_data")
# Options a resumed run may change: how long (steps, checked with --extend against the checkpoint), how
# it saves, evaluates (a forward of held-out rows that touches no training state), waits and threads, and
# where it runs (resuming onto another layout is exact; onto another device, within the dtype's rounding).
CHANGEABLE_ON_RESUME = ("steps", "save_every", "eval_every", "eval_batches", "timeout_s", "threads", "device",
                        "deterministic",
                        *(f.name for f in dataclasses.fields(Layout)),
                        *(f.name for f in dataclasses.fields(ParallelConfig) if f.name != "param_dtype"))
# The same list as a user reads it, in `train --help`, the refusal and docs/training.md.
CHANGEABLE_ON_RESUME_TEXT = ("--steps with --extend, --save-every, --eval-every, --eval-batches, --timeout-s, "
                             "--threads, --device, --deterministic, and every layout and parallel flag except "
                             "--param-dtype, and --microbatches of a MoE model with a balancing loss")
# Compared through the data record (content, not path) and the model's fields, not as option values; the
# tokenizer too where the record has a data record (`_check_same_tokenizer`), else as an option.
_COMPARED_APART = ("model", "data", "corpus_bytes")


def describe_data(cfg: TrainConfig) -> dict[str, Any]:
    """The run's data as the record keeps it: source, tokenizer, size and hash of the text, and its files; for a
    prepared dataset its folder, token count, size of its token file and the hash of its dataset.json (which
    holds the hashes of the rest)."""
    tokenizer = cfg.tokenizer or "byte"
    if cfg.prepared_data is not None:
        meta = read_meta(cfg.prepared_data)
        folder = Path(cfg.prepared_data)
        tokens = (folder / TOKENS_FILE).stat()
        # The later status change of the two files dataset.json hashes: any write moves it, and no `touch` or
        # copy with kept times can set it back (a move or copy moves it too, and costs one hash on resume).
        changed_ns = max(tokens.st_ctime_ns, (folder / DOCUMENTS_FILE).stat().st_ctime_ns)
        ids = {"tokenizer_ids_sha256": meta["tokenizer_ids_sha256"]} if meta.get("tokenizer_ids_sha256") else {}
        return {"source": "prepared", "path": str(folder.absolute()), "tokenizer": tokenizer, **ids,
                "tokens": meta["tokens"], "bytes": tokens.st_size, "changed_ns": changed_ns,
                "sha256": meta_sha256(folder)}
    text = read_text_files(cfg.data) if cfg.data is not None else stdlib_corpus(cfg.corpus_bytes)
    encoded = text.encode("utf-8")
    record: dict[str, Any] = {"source": "files" if cfg.data is not None else "stdlib", "tokenizer": tokenizer,
                              "bytes": len(encoded), "sha256": hashlib.sha256(encoded).hexdigest()}
    if cfg.data is not None:
        record["files"] = [file_record(path) for path in cfg.data]
    if tokenizer != "byte":  # kept by path: what it encodes to is recorded too (a prepared dataset's own record has it)
        from orangetron.train.tokenizer import tokenizer_named  # torch: only for a run with a tokenizer file

        record["tokenizer_ids_sha256"] = tokenizer_named(tokenizer).ids_sha256()
    return record


def read_record(out: str | Path) -> dict[str, Any] | None:
    """The parsed config.toml of run folder `out`, or None when it has none."""
    path = Path(out) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TrainConfigError(f"resume=True (--resume): {path} is not a TOML file ({err})") from None


def recorded_model(record: dict[str, Any]) -> ModelSpec | str | None:
    """The record's model: a spec from its `[model]` table, a name from an older record, or None."""
    model = record.get("model")
    if isinstance(model, dict):
        spec = parse_model(str(model.get("name", "model")), model)
        if not isinstance(spec, ModelSpec):
            raise TrainConfigError("the [model] table describes a dual encoder, which the trainer does not run")
        return spec
    return model


@contextmanager
def held(cfg: TrainConfig) -> Iterator[None]:
    """The run folder, this run's until it ends: `claim`'s refusals, then the folder locked (`folder_lock`), so a
    second `train` into it while this one runs, a resume say, is refused in one line instead of both writing
    its metrics and checkpoints; an old run moves aside on `overwrite` under the lock, and the new folder is
    locked in turn. The process that speaks for the run holds it (`folder_lock.primary_process`)."""
    folder = Path(cfg.out) if cfg.out is not None else None
    primary = folder is not None and folder_lock.primary_process()
    made = folder is not None and not folder.exists()
    was_empty = folder is not None and folder.is_dir() and not any(folder.iterdir())
    # A folder that holds a run, or a run's lock, is locked first: a resume beside a run still setting up is
    # told the run is there, not that it has no checkpoint. Any other only once claimed: a refused --out (the
    # model folder the run imports, say) gets no lock file.
    early = primary and bool(_occupant(folder) or (folder / folder_lock.LOCK_FILE).exists())
    lock = folder_lock.take(folder) if early else None
    try:
        moves_aside = claim(cfg)
        if not primary:
            yield
            return
        if not early:
            lock = folder_lock.take(folder)
        if moves_aside:
            aside = move_aside(folder)  # the lock file goes with it, still held: no run was in there
            print(f"orangetron train: moved the former run in {cfg.out} to {aside} (the whole folder, with any "
                  "other files it held)", file=sys.stderr)
            lock, former, made = folder_lock.take(folder), lock, True
            folder_lock.release(former, aside, made=False)
        yield
    finally:
        if primary:
            folder_lock.release(lock, folder, made, was_empty)


def claim(cfg: TrainConfig) -> bool:
    """Before any rank starts: refuse what the run folder forbids; whether an old run is to move aside
    (`overwrite`), which `held` does."""
    if cfg.out is None:
        return False
    if cfg.resume:
        _claim_resume(cfg)
        return False
    sources = [("--hf-model", cfg.hf_model), ("--tokenizer", cfg.tokenizer), *(("--data", d) for d in cfg.data or [])]
    for flag, source in sources:
        if source is not None and Path(source).is_dir() and Path(source).resolve() == Path(cfg.out).resolve():
            raise TrainConfigError(f"out={cfg.out!r} (--out): the {flag} folder the run reads; its checkpoints, "
                                   "record and metrics would mix with those files: give the run a folder of its own")
    above = _run_folder_above(Path(cfg.out))
    if above is not None:  # `--out RUN/checkpoints/step-N` made a step no checkpoint, which broke RUN's resume
        raise TrainConfigError(f"out={cfg.out!r} (--out): inside the folder of another run, {above}, which holds "
                               "that run alone; give a folder outside it")
    occupant = _occupant(Path(cfg.out))
    if occupant is None:
        return False
    if not cfg.overwrite:
        from orangetron.train.checkpoint import latest_checkpoint  # torch: only for a folder that holds a run

        if latest_checkpoint(Path(cfg.out) / "checkpoints") is None:
            raise TrainConfigError(f"out={cfg.out!r} (--out): the folder holds a run that saved no checkpoint "
                                   f"({occupant}), so nothing to resume; choose another folder, or add --overwrite "
                                   "to move it aside")
        raise TrainConfigError(f"out={cfg.out!r} (--out): the folder holds another run ({occupant}); continue it "
                               "with --resume, choose another folder, or add --overwrite to move it aside")
    inputs = [("the run's data", path) for path in cfg.data or []]
    tokenizer = None if cfg.tokenizer == "byte" else cfg.tokenizer
    inputs += [("the model to import", cfg.hf_model), ("the tokenizer", tokenizer)]
    check_holds_no_input(Path(cfg.out), "--out", inputs)  # moving the old run aside would take them along
    return True


def _claim_resume(cfg: TrainConfig) -> None:
    """`claim` for a resume: a checkpoint to resume, and the record's (or, without one, the checkpoint's) refusals
    of what may not change."""
    from orangetron.train.checkpoint import latest_checkpoint  # torch: only when resuming

    if not Path(cfg.out).is_dir():  # a mistyped --out, rather than a run that saved nothing
        raise TrainConfigError(f"resume=True (--resume): there is no run folder {cfg.out} to resume")
    latest = latest_checkpoint(Path(cfg.out) / "checkpoints")
    if latest is None:  # before the run is announced, not after
        saved_none = "; the run there saved none: start afresh with --overwrite (it moves the folder aside)" \
            if _occupant(Path(cfg.out)) else ""
        raise TrainConfigError(f"resume=True (--resume): no checkpoint under {Path(cfg.out) / 'checkpoints'}"
                               + saved_none)
    record = read_record(cfg.out)
    if record is not None:
        check_resume(cfg, record)
    elif folder_lock.primary_process():  # a refusal below then names flags the user never gave
        print(f"orangetron train: warning: {Path(cfg.out) / CONFIG_FILE} is missing, so the run's options come "
              "from this command's flags and their defaults; its checkpoint refuses those that differ from the "
              "run's, but cannot tell whether the data's text changed", file=sys.stderr)
    _check_checkpoint(cfg, latest)


def _check_checkpoint(cfg: TrainConfig, checkpoint: Path) -> None:
    """Refuse here, before any rank starts, a resume with no step left and the flags the checkpoint's schedule
    forbids (`check_steps_left`, `continue_schedule`: the ranks apply both again where they read it). A state that
    cannot be read is left to that load, which names the checkpoint before it."""
    from orangetron.train.checkpoint import CheckpointError, read_state
    from orangetron.train.resume import check_steps_left
    from orangetron.train.schedule import continue_schedule

    try:
        state = read_state(checkpoint)
        step = int(state["step"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return
    check_steps_left(cfg, checkpoint, step)
    continue_schedule(cfg, state.get("schedule"), checkpoint)
    _check_checkpoint_options(cfg, checkpoint, state.get("options"))


# Left to the record's data and tokenizer comparison, which reads their content: a copy at another path resumes.
_PATHS = ("data", "tokenizer", "hf_model")


def _check_checkpoint_options(cfg: TrainConfig, checkpoint: Path, written: dict[str, Any] | None) -> None:
    """Refuse an option the checkpoint was written with (checkpoints before 2026-12-07 hold none) that this resume
    changes and may not: with config.toml gone, or edited, the record's checks see only this command's values."""
    if not isinstance(written, dict):
        return
    given = cfg.options()
    # The corpus size names the data only where the run read the built-in corpus, and new data replaces it.
    idle_corpus = cfg.new_data or written.get("data") is not None
    free = (*CHANGEABLE_ON_RESUME, *DIRECTIVES, *_PATHS, "model", *(("corpus_bytes",) if idle_corpus else ()))
    for name, value in written.items():
        now = given.get(name)
        if name in free or name not in given or now == value or isinstance(now, tuple) and list(now) == value:
            continue
        raise TrainConfigError(f"{name}={now!r} ({_flag(name)}): {checkpoint} was written by a run with "
                               f"{name}={value!r}, and a resumed run keeps it (changeable: "
                               f"{CHANGEABLE_ON_RESUME_TEXT})")
    _check_same_split(cfg, written)


def _run_folder_above(folder: Path) -> Path | None:
    """The nearest folder above `folder` (`..` and links resolved) that holds a run: a checkpoint, or a record
    of its data (a project's own config.toml beside a checkpoints folder is not one)."""
    for parent in folder.resolve().parents:
        if holds_checkpoints(parent / "checkpoints") or _holds_record(parent):
            return parent
    return None


def record_folder(config: str) -> Path | None:
    """The run folder a `--config` path is the record of (DIR, or DIR/config.toml, whose file a run wrote), or
    None for any other file: a plan's, or a project's own config.toml."""
    path = Path(config)
    folder = path if path.is_dir() else path.parent
    if (path.is_dir() or path.name == CONFIG_FILE) and _holds_record(folder):
        return folder.resolve()
    return None


def _holds_record(folder: Path) -> bool:
    try:
        return "data_record" in tomllib.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


def _occupant(folder: Path) -> str | None:
    found = [name for name in RUN_FILES if (folder / name).exists()]
    return ", ".join(found) if found else None


def check_resume(cfg: TrainConfig, record: dict[str, Any]) -> None:
    """Refuse a resume that changes what the run is: an option outside CHANGEABLE_ON_RESUME, the model, or
    (without `new_data`) the data's text."""
    recorded = _recorded_options(record)
    given = cfg.options()
    apart = (*_COMPARED_APART, "tokenizer") if "data_record" in record else _COMPARED_APART
    for name, value in recorded.items():
        if name in given and name not in (*CHANGEABLE_ON_RESUME, *DIRECTIVES, *apart) and given[name] != value:
            if name == "hf_model":  # moved with the run, say: the flag is not needed, as no weight is read
                raise TrainConfigError(f"hf_model={given[name]!r} (--hf-model): a resumed run reads no weight from "
                                       f"it (its checkpoints hold them, and the record of its source {value}); "
                                       "leave the flag out")
            raise TrainConfigError(f"{name}={given[name]!r} ({_flag(name)}): the run in {cfg.out} was recorded with "
                                   f"{name}={value!r}, and a resumed run keeps it (changeable: "
                                   f"{CHANGEABLE_ON_RESUME_TEXT})")
    _check_same_split(cfg, recorded)
    _check_same_model(cfg, record)
    if "data_record" in record:
        data = describe_data(cfg)
        _check_same_tokenizer(cfg, data, record["data_record"])  # new data or not: the ids the model learnt
        if not cfg.new_data:
            _check_same_data(cfg, data, record["data_record"])


def _check_same_split(cfg: TrainConfig, recorded: dict[str, Any]) -> None:
    """A MoE model's balancing loss is computed micro-batch by micro-batch (each over that micro-batch's tokens on
    every rank, docs/pipeline_parallel.md): a product of means, which another split changes. Another
    `--microbatches` would train another objective, unsaid, so only a model without that loss may change it."""
    model, then = cfg.model_config(), recorded.get("microbatches")
    if then is None or then == cfg.microbatches or not (model.is_moe and model.aux_loss_coef > 0):
        return
    raise TrainConfigError(f"microbatches={cfg.microbatches} (--microbatches): the run in {cfg.out} was recorded with "
                           f"microbatches={then}, and its MoE balancing loss (aux_loss_coef={model.aux_loss_coef}) is "
                           "computed per micro-batch, so another split trains another objective; resume with "
                           f"--microbatches {then}")


def check_repeat(cfg: TrainConfig, path: str, typed: set[str]) -> None:
    """A new run given a run's record (`train --config RUN/config.toml --out NEW`) repeats that run: refuse it
    where the recorded data, tokenizer or Hugging Face folder changed since, unless the command line names them
    (`typed`: the options it gave; then they are this run's own). A folder's weights are recorded by size, so
    one rewritten at its size passes."""
    record = read_toml(path)  # a run folder stands for its config.toml
    recorded = record.get("data_record")
    if isinstance(recorded, dict) and "sha256" in recorded and not typed & {"data", "corpus_bytes"}:
        _check_repeat_data(cfg, path, recorded, tokenizer_typed="tokenizer" in typed)
    source = record.get("model_source")
    if isinstance(source, dict) and cfg.hf_model is not None and "hf_model" not in typed:
        _check_repeat_folder(cfg, path, source)


def _check_repeat_data(cfg: TrainConfig, path: str, recorded: dict[str, Any], tokenizer_typed: bool) -> None:
    given = describe_data(cfg)
    if given["sha256"] != recorded["sha256"]:
        if recorded.get("source") == given["source"] == "stdlib":  # this Python's library: no flag undoes it
            print(f"orangetron train: warning: the built-in corpus differs from the one --config {path} records "
                  f"({_data_summary(recorded)}; now {_data_summary(given)}): another Python's standard library, so "
                  "this run does not repeat that one bit for bit", file=sys.stderr)
            return
        aside = _moved_dataset(cfg.prepared_data, recorded) if cfg.prepared_data else None
        where = f"; the recorded dataset is at {aside}, where an --overwrite moved it" if aside else ""
        raise TrainConfigError(f"data: --config {path} repeats a run on {_data_summary(recorded)}; the data is now "
                               f"{_data_summary(given)}{where}: restore it, or give --data on the command line to "
                               "train on it as it is now")
    then, now = recorded.get("tokenizer_ids_sha256"), given.get("tokenizer_ids_sha256")
    # A prepared dataset's ids are in its hash; a tokenizer the command line names is this run's own.
    if then and now and then != now and recorded.get("source") != "prepared" and not tokenizer_typed:
        raise TrainConfigError(f"tokenizer: --config {path} repeats a run whose tokenizer {given['tokenizer']} "
                               f"encoded other ids (sha256 {then[:12]} then, {now[:12]} now): restore it, or give "
                               "--tokenizer on the command line to train with it as it is now")
    if cfg.prepared_data and _touched_since(Path(cfg.prepared_data), recorded, given):
        _check_prepared_files(Path(cfg.prepared_data))


def _check_repeat_folder(cfg: TrainConfig, path: str, source: dict[str, Any]) -> None:
    from orangetron.hf.folder import describe_folder

    now = describe_folder(cfg.hf_model)
    parts = {"config_sha256": "config.json", "index_sha256": "safetensors index", "files": "weight files' sizes"}
    changed = [part for key, part in parts.items() if now.get(key) != source.get(key)]
    if changed:
        verb = "differ" if len(changed) > 1 else "differs"
        raise TrainConfigError(f"hf_model={cfg.hf_model!r}: --config {path} repeats a run that started from this "
                               f"folder, whose {' and '.join(changed)} {verb} now: restore it, or give --hf-model "
                               "on the command line to start from it as it is now")


def _recorded_options(record: dict[str, Any]) -> dict[str, Any]:
    options = {k: v for k, v in record.items() if not isinstance(v, dict)}
    if "dtype" in options:  # the field's name before `param_dtype`
        options["param_dtype"] = options.pop("dtype")
    options.setdefault("pack_documents", False)  # recorded before packing existed: the run trained unpacked
    return options


def _check_same_model(cfg: TrainConfig, record: dict[str, Any]) -> None:
    model = recorded_model(record)
    if model is None:
        return
    stored = model if isinstance(model, ModelSpec) else TrainConfig(model=model).model_config()
    built = cfg.model_config()
    for field in dataclasses.fields(ModelSpec):
        if field.name != "name" and getattr(built, field.name) != getattr(stored, field.name):
            raise TrainConfigError(f"model={built.name!r} (--model): the run in {cfg.out} was recorded with model "
                                   f"{field.name}={getattr(stored, field.name)!r}, this one has "
                                   f"{getattr(built, field.name)!r}")


def _check_prepared_files(folder: Path) -> None:
    """A prepared dataset's token and document files against the hashes its dataset.json holds: one read of
    each, done only when either file changed after the run recorded it."""
    for name, sha256 in read_meta(folder)["sha256"].items():
        if file_sha256(folder / name) != sha256:
            raise TrainConfigError(f"data (--data): {folder / name} changed after `prepare-data` wrote it (its "
                                   f"sha256 is no longer dataset.json's {sha256[:12]}); prepare the data again")


def _touched_since(folder: Path | None, recorded: dict[str, Any], given: dict[str, Any]) -> bool:
    """Whether a prepared dataset's files may have changed since the run recorded them: their status change time
    moved, or, in a record of 2026-12-04 (the token file's modification time then), that time moved."""
    if "changed_ns" in recorded:
        return given.get("changed_ns") != recorded["changed_ns"]
    if "modified_ns" in recorded and folder is not None:
        return (folder / TOKENS_FILE).stat().st_mtime_ns != recorded["modified_ns"]
    return False  # a record from before either: text files, or a dataset recorded by its dataset.json alone


def _check_same_tokenizer(cfg: TrainConfig, given: dict[str, Any], recorded: dict[str, Any]) -> None:
    """A resumed run keeps the tokenizer its model learnt the ids of: the recorded one, or one at another path
    (a copy, say: `tokenizer export` writes the checkpoint's) that encodes the same ids. The ids are compared where
    the record has their hash (text since 2026-12-05; a prepared dataset's since 2026-12-06), else the path."""
    then, now = recorded.get("tokenizer_ids_sha256"), given.get("tokenizer_ids_sha256")
    if then is None and recorded.get("source") == given["source"] == "prepared" \
            and recorded.get("sha256") == given["sha256"]:
        then = now  # a record of before 2026-12-06: the same dataset.json holds the hash (`describe_data`)
    path, was = given["tokenizer"], recorded.get("tokenizer", "byte")
    if path == was and then and now != then:
        raise TrainConfigError(f"tokenizer (--tokenizer): {path} encodes other ids than when the run in {cfg.out} "
                               f"started (ids sha256 {then[:12]} then, {str(now)[:12]} now): it was rewritten at the "
                               f"same path; restore it, or give --tokenizer DIR after `orangetron tokenizer export "
                               f"{cfg.out} -o DIR` writes the copy its checkpoint keeps, or start a new run")
    if path != was and not (then and now == then):
        other = f", which encodes other ids (sha256 {then[:12]}, this one {str(now)[:12]})" if then and now else ""
        raise TrainConfigError(f"tokenizer={path!r} (--tokenizer): the run in {cfg.out} was recorded with "
                               f"tokenizer={was!r}{other}; a resumed run keeps it{_copy_hint(cfg, was, then)}")


def _copy_hint(cfg: TrainConfig, was: str, then: str | None) -> str:
    """How a resume refused another tokenizer can go on: a copy of the run's (by its ids, where recorded)."""
    if was == "byte":
        return ""
    if then is None:
        return " (its record holds no hash of the ids to compare another path by)"
    return (f", or a copy of it at another path that encodes the same ids (`orangetron tokenizer export {cfg.out} "
            "-o DIR` writes one)")


def _check_same_data(cfg: TrainConfig, given: dict[str, Any], recorded: dict[str, Any]) -> None:
    if given["sha256"] == recorded.get("sha256"):
        if _touched_since(Path(cfg.prepared_data) if cfg.prepared_data else None, recorded, given):
            _check_prepared_files(Path(cfg.prepared_data))  # a copy passes, an edit does not
        return
    # The embedded corpus changes only with --corpus-bytes (or the interpreter's library): no --data names it.
    hint = ("give the recorded --corpus-bytes" if recorded.get("source") == given["source"] == "stdlib"
            else "to continue on other data give it with --data and add --new-data")
    moved = _moved_dataset(cfg.prepared_data, recorded) if cfg.prepared_data else None
    if moved is not None:
        hint = f"the run's dataset is at {moved}, where an --overwrite moved it: give that with --data; or {hint}"
    raise TrainConfigError(f"data (--data): differs from the run's record in {Path(cfg.out) / CONFIG_FILE} "
                           f"(recorded {_data_summary(recorded)}; now {_data_summary(given)}); {hint}")


def _moved_dataset(folder: str, recorded: dict[str, Any]) -> Path | None:
    """The `FOLDER.previous-N` beside `folder` that holds the recorded dataset (`prepare-data --overwrite` moved
    it there), if one does."""
    for aside in sorted(Path(folder).parent.glob(f"{Path(folder).name}.previous-*")):
        if (aside / DATASET_FILE).is_file() and meta_sha256(aside) == recorded.get("sha256"):
            return aside
    return None


def _data_summary(record: dict[str, Any]) -> str:
    files = record.get("files")
    where = f"{len(files)} file(s)" if files else str(record.get("source"))
    return f"{where}, {record.get('bytes', 0):,} bytes, sha256 {str(record.get('sha256'))[:12]}"


def write_record(cfg: TrainConfig, data: dict[str, Any], first_step: int) -> Path:
    """Write config.toml for `cfg` (rank 0). A resumed run first appends what it changed to changes.jsonl."""
    folder = Path(cfg.out)
    folder.mkdir(parents=True, exist_ok=True)
    tables = {"model": dataclasses.asdict(cfg.model_config()), "data_record": data}
    if cfg.hf_model is not None:
        tables["model_source"] = {k: v for k, v in model_source(cfg).items() if k not in PARSED_FILES}
    options = {k: v for k, v in cfg.options().items() if k not in DIRECTIVES[1:] and k != "model"}
    if options.get("data"):  # absolute, as hf_model and tokenizer are: resumed or repeated from any folder
        options["data"] = [str(Path(path).resolve()) for path in options["data"]]
    options["out"] = str(folder.resolve())  # `train --config DIR/config.toml` elsewhere: this run, not ./DIR
    if cfg.resume:
        previous = read_record(folder)
        if previous is not None:
            _log_changes(folder, first_step, previous, {**options, **tables})
    write_resolved_config(folder / CONFIG_FILE, options, tables)
    return folder / CONFIG_FILE


def model_source(cfg: TrainConfig) -> dict[str, Any]:
    """The Hugging Face folder a run started from (`orangetron.hf.describe_folder`: path, hashes of config.json and
    of the index, file sizes, dtype) with its parsed config and, where it has one, generation config (export
    writes both back); the weights themselves come from checkpoints after. A resumed run keeps what its
    checkpoint recorded: it reads no weight from the folder, which may have changed or gone since."""
    from orangetron.hf.folder import describe_folder, read_generation_config
    from orangetron.spec.hf_config import read_config

    recorded = _recorded_model_source(cfg) if cfg.resume else None
    if recorded:
        return recorded
    generation = read_generation_config(cfg.hf_model)
    return {**describe_folder(cfg.hf_model), "config": read_config(cfg.hf_model),
            **({"generation_config": generation} if generation is not None else {})}


def _recorded_model_source(cfg: TrainConfig) -> dict[str, Any] | None:
    from orangetron.train.checkpoint import STATE_FILE, latest_checkpoint

    latest = latest_checkpoint(Path(cfg.out) / "checkpoints") if cfg.out else None
    return None if latest is None else json.loads((latest / STATE_FILE).read_text()).get("model_source")


def _log_changes(folder: Path, step: int, previous: dict[str, Any], now: dict[str, Any]) -> None:
    changed = {k: [previous.get(k), v] for k, v in now.items() if previous.get(k) != v}
    if changed:
        with open(folder / CHANGES_FILE, "a", encoding="utf-8") as log:
            log.write(json.dumps({"from_step": step + 1, "changed": changed}) + "\n")
