"""`TrainConfig`: every option of a training run, validated on construction.

A `TrainConfig` is a `Layout` and a `ParallelConfig` (spec/): it inherits their fields, so `TrainConfig(tp=2,
cp_mode="usp")` and the flags of the same names set them, and `layout` and `parallel_config()` hand the runtime
those parts on their own. Importing this module does not import torch (the CLI builds its flags from these
defaults and answers `--help` at once); validation that needs the model or the runtime imports them on use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from orangetron.hf.folder import check_weight_files
from orangetron.model.config import MODEL_PRESETS, ConfigError, check_runnable, model_preset
from orangetron.spec import rules
from orangetron.spec.hf_config import is_hf_folder, spec_from_hf
from orangetron.spec.hf_config import read_config as read_hf_config
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec, load_decoder, preset_names
from orangetron.spec.parallel_config import ParallelConfig, values_of
from orangetron.spec.stages import longest_chunk
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES
from orangetron.train.corpus import DEFAULT_CORPUS_BYTES
from orangetron.train.datasets import is_prepared_dataset, read_meta
from orangetron.train.faults import DEFAULT_TIMEOUT_S

# `verify`: the promise per dtype. bfloat16's is not a promise of the project but what its 8-bit mantissa gives:
# `verify --dp 2 --param-dtype bfloat16` measured 1.3e-2 to 2.5e-2 over seeds 0-7, so 5e-2 leaves a margin.
DEFAULT_TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 5e-2}
PARAM_DTYPES = ("float32", "float64", "bfloat16")  # parallel.config.DTYPES's names (a test keeps them equal)
# Inherited fields `train` takes no flag for: the planner's expert folding, which the runtime refuses.
# `options()` writes them only when set, so a run folder's config.toml stays a file that `--config` reads (a
# test keeps every other field a flag).
WITHOUT_FLAGS = ("etp", "expert_fold")


class TrainConfigError(ValueError):
    """A training configuration that cannot run; the message names the field, its flag and the rule."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_batch_split(batch_size: int, dp: int, microbatches: int) -> None:
    """A step's batch splits evenly over the data-parallel ranks and the micro-batches (`train` and `estimate
    --config` check it alike); TrainConfigError otherwise."""
    if batch_size % (dp * microbatches):
        raise TrainConfigError(f"batch_size={batch_size} (--batch-size): must divide by dp*microbatches="
                               f"{dp * microbatches}, each data-parallel rank takes an equal share of every "
                               "micro-batch")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Layout, ParallelConfig):
    """Everything one training run needs: its layout and parallel options (the fields of `Layout` and
    `ParallelConfig`, inherited; `param_dtype` is the parameters' dtype, flag `--param-dtype` or `--dtype`) and
    the run's own below. Validated on construction (TrainConfigError, or the rule's own error).

    The defaults are what `orangetron train` runs with no flags: small-moe learns visibly (byte-level
    loss from ~5.6 to ~2.1) in about a minute on one CPU thread. Many small, frequent updates
    (8 x 64 tokens) learned faster per second than fewer large ones when tuned on a 2-core machine.
    """

    model: str | ModelSpec = "small-moe"  # a train preset (MODEL_PRESETS), a planner preset, a .toml model file,
    # or a ModelSpec (ModelConfig(...) builds one); the runtime refuses what it cannot build (check_runnable)
    steps: int = 200  # optimizer steps
    seq_len: int = 64  # tokens per sample fed to the model (labels are shifted by one)
    batch_size: int = 8  # samples per step
    lr: float = 2e-3  # peak learning rate, reached after `warmup` steps
    warmup: int = 20  # linear warmup steps
    min_lr: float = 2e-4  # floor of the cosine decay, reached at the last step
    weight_decay: float = 0.1  # AdamW decay, applied to matrices only (not norms or biases)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0  # seeds model init and batch order; same seed -> bitwise-identical losses
    eval_every: int = 0  # evaluate held-out loss every N steps (0: only at the end)
    eval_batches: int = 16  # batches of held-out data per evaluation
    eval_fraction: float = 0.05  # share of the token stream, from its end, held out for evaluation
    hf_model: str | None = None  # a Hugging Face folder: its config.json is the model (instead of `model`) and
    # its safetensors the initial weights, each rank reading its own share (orangetron.hf)
    tokenizer: str | None = None  # "byte", or a tokenizer folder or tokenizer.json (train/tokenizer.py); None:
    # a prepared dataset's tokenizer, else the hf_model folder's when it has one, else "byte"
    data: Sequence[str] | None = None  # text files, or one prepared dataset folder (`orangetron prepare-data`), to
    # train on; None: the embedded stdlib corpus
    corpus_bytes: int = DEFAULT_CORPUS_BYTES  # bytes of the stdlib corpus to use when `data` is None
    pack_documents: bool | None = None  # attend within documents only, positions restarting in each, no label
    # across a boundary (docs/training.md, Packed documents); None: on for a prepared dataset, off for text
    out: str | None = None  # run folder for metrics.jsonl and checkpoints (always one after the last step)
    save_every: int = 0  # also write a checkpoint every N steps (0: only after the last one); needs `out`
    resume: bool = False  # continue from the latest checkpoint in `out`, on whatever layout this run has
    extend: bool = False  # with resume: allow `steps` past the checkpoint's total; the cosine keeps its old
    # span (`schedule_steps`) and the rate holds its last value after it
    stop_after: int = 0  # end after this step, checkpointed, with the schedule of `steps` (0: run to `steps`)
    overwrite: bool = False  # a new run into an `out` that holds another run moves that run aside (never deletes)
    new_data: bool = False  # with resume: continue on `data` whose content differs from the run's record
    schedule_steps: int | None = None  # steps the warmup + cosine span; None: `steps` (an extension sets it)
    threads: int | None = 1  # CPU threads for torch ops; None keeps torch's setting (see train())
    timeout_s: float = DEFAULT_TIMEOUT_S  # seconds a collective waits for a peer; then the run stops, naming
    # the rank that stopped responding
    deterministic: bool = False  # torch's deterministic algorithms (and cuBLAS's on cuda): reruns bitwise equal
    device: str | None = None  # "cpu" or "cuda" (one GPU per local rank); None: cuda when torch sees a GPU, else
    # cpu (resolved on construction, so the record holds what ran)

    __str__ = object.__str__  # the dataclass repr: a run is more than the layout `Layout.__str__` prints

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_checkpointing()
        self._resolve_hf_model()
        # Before the layout's rules: an --ep for a model without experts is told so, not to add ranks.
        self._check_model()
        self._check_device()
        self._check_parallel()
        model = self.model_config()
        self.layout.validate(model)
        self._check_context_mode(model)
        from orangetron.parallel.pipeline import check_pipeline  # torch: validation only, not the CLI's import

        check_pipeline(model, self.pp, self.parallel_config())
        if self.tp > 1 and self.sequence_parallel and self.cp == 1:  # cp > 1 pads to whole chunks instead
            self.layout.validate(seq_len=self.seq_len, sequence_parallel=True)
        self._check_data()
        self._resolve_tokenizer(model)
        self._resolve_packing()

    def _check_numbers(self) -> None:
        check_numbers({f.name: getattr(self, f.name) for f in fields(self)})

    def _check_device(self) -> None:
        from orangetron.train import placement  # torch: validation only, not the CLI's import

        if self.device is None:
            object.__setattr__(self, "device", placement.default_device())  # frozen: resolved once, here
        try:
            placement.check_device(self.device, placement.local_ranks(self.layout.world_size))
        except placement.PlacementError as err:
            raise TrainConfigError(str(err)) from None

    def _check_parallel(self) -> None:
        """The layout's and the options' rules (each checks its own on construction), then what the runtime does
        not run, then the schedule's micro-batches and the batch's split over them, before any rank starts."""
        from orangetron.mesh import check_runnable_layout  # torch: validation only, not the CLI's import
        from orangetron.parallel.config import check_runnable

        check_runnable_layout(self.layout)
        check_runnable(self.parallel_config())
        SCHEDULES[self.pp_schedule].check(self.pp, self.microbatches)
        check_batch_split(self.batch_size, self.dp, self.microbatches)

    def _check_context_mode(self, model: ModelSpec) -> None:
        """The cp mode's rules, before any rank starts: its Ulysses degree and the heads it splits."""
        mode = CONTEXT_MODES[self.cp_mode]
        if self.cp == 1:
            return
        if mode.takes_ulysses_degree:
            rules.ulysses_degree_divides_cp(self.ulysses_degree, self.cp)
        split = mode.head_split(self.cp, self.ulysses_degree)
        if split > 1:
            heads, kv_heads = model.num_heads // self.tp, max(1, model.num_kv_heads // self.tp)
            rules.heads_split_by_all_to_all(split, heads, kv_heads, mode.head_split_field)

    def ineffective_options(self) -> list[str]:
        """One line for each option set away from its default that does nothing on this run: a flag for a
        dimension of size 1, or for a variant the run does not use. The trainer shows them as warnings."""
        default = {f.name: f.default for f in fields(self)}
        dispatcher = DISPATCHERS[self.dispatcher]  # its record says what it takes, not its name
        longest = longest_chunk(self.model_config().num_layers, self.pp, self.virtual_stages)
        changed = {name for name in default if getattr(self, name) != default[name]}
        unused = {
            "sequence_parallel": (self.tp == 1, "needs --tp > 1"),
            "cp_mode": (self.cp == 1, "needs --cp > 1"),
            "ulysses_degree": (self.cp == 1, "needs --cp > 1"),
            "pp_schedule": (self.pp == 1, "needs --pp > 1"),
            "dispatcher": (self.ep == 1, "needs --ep > 1"),
            "capacity_factor": (not dispatcher.pads or self.ep == 1, "needs --dispatcher capacity with --ep"),
            "drop_policy": (not dispatcher.pads or self.ep == 1, "needs --dispatcher capacity with --ep"),
            "reduce_dtype": (self.dp * self.cp == 1, "needs --dp or --cp > 1: no gradient reduction"),
            "ep_overlap_chunks": (not dispatcher.chunked or self.ep == 1, "needs --dispatcher ragged with --ep"),
            "zero3_prefetch": (self.zero_stage != 3, "needs --zero-stage 3"),
            "zero3_keep_params": (self.zero_stage != 3, "needs --zero-stage 3"),
            "distributed_optimizer": (self.dp * self.cp == 1, "needs --dp or --cp > 1: nothing to shard"),
            # ZeRO-3 at dp x cp = 1 still gathers, frees and reduces unit by unit: its memory differs from DDP's
            "zero_stage": (self.dp * self.cp == 1 and self.zero_stage != 3, "needs --dp or --cp > 1: nothing to shard"),
            "recompute": (self.recompute == "selective", "every attention kernel the runtime runs already "
                          "recomputes its scores in backward, which is what selective recompute saves "
                          "(docs/runtime.md, Activation recompute)"),
            "recompute_layers": (self.recompute_layers >= longest, f"is not below the {longest} layers of the "
                                 "longest pipeline chunk: every layer replays, as with 0"),
            "eval_every": (self.eval_every >= self.steps, f"is not before --steps={self.steps}: only the final "
                           "evaluation runs"),
            "save_every": (self.save_every >= self.steps, f"is not before --steps={self.steps}: only the final "
                           "checkpoint is written"),
        }
        # A switch a resume or a --config file turned on is turned off by its negation, which the line names.
        lines = [f"{name}={getattr(self, name)!r} ({_flag(name)}) has no effect: {why}"
                 + (f" ({_flag('no_' + name)} turns it off)" if getattr(self, name) is True else "")
                 for name, (idle, why) in unused.items() if name in changed and idle]
        if self.cp > 1 and CONTEXT_MODES[self.cp_mode].takes_ulysses_degree and self.ulysses_degree == 1:
            lines.append(f"cp_mode={self.cp_mode!r} (--cp-mode) with ulysses_degree=1 runs as ring attention over "
                         "all cp ranks: give --ulysses-degree N for N-way all-to-all")
        return lines

    def warnings(self) -> list[str]:
        """What the trainer warns of before it starts: `ineffective_options`, a warmup that leaves the schedule
        no cosine (the rate never decays, and an extension holds the rate it reached), and a model or tokenizer
        that is probably not the one meant (a Hugging Face folder as --model trains its architecture from random
        weights; a --hf-model folder without a tokenizer trains its weights on byte ids, one with its own
        tokenizer on the ids of a prepared dataset's other one, or whose documents end in another id than its
        config's eos_token_id)."""
        from orangetron.train.tokenizer import has_tokenizer

        notes = self.ineffective_options()
        span = self.schedule_steps if self.schedule_steps is not None else self.steps
        if self.warmup and span - self.warmup <= 1:  # `schedule.lr_at`: a cosine needs two steps to decay
            reached = self.lr * min(span, self.warmup) / self.warmup
            notes.append(f"warmup={self.warmup} (--warmup) leaves the schedule's {span} steps no cosine: the rate "
                         f"rises to {reached:g} and never decays to min_lr")
        if isinstance(self.model, str) and is_hf_folder(self.model):
            notes.append(f"model={self.model!r} (--model) is a Hugging Face folder: only its architecture is used, "
                         f"from random weights; --hf-model {self.model} starts from its weights and tokenizer")
        # A resumed run's weights come from its checkpoints, its tokenizer from its record (checked there): the
        # folder's own tokenizer, retrained since say, says nothing about them.
        fresh_hf = self.hf_model is not None and not self.resume and Path(self.hf_model).exists()
        if fresh_hf and self.tokenizer == "byte" and not has_tokenizer(self.hf_model):
            notes.append(f"hf_model={self.hf_model!r} (--hf-model) has no tokenizer files: its weights train on the "
                         "byte tokenizer's ids, not the ones it was trained on; give --tokenizer")
        if fresh_hf and has_tokenizer(self.hf_model) and not _same_ids(self.hf_model, self.tokenizer):
            notes.append(f"hf_model={self.hf_model!r} (--hf-model): its weights train on the ids of the prepared "
                         f"dataset's tokenizer {self.tokenizer}, not its own; prepare the data with --tokenizer "
                         f"{self.hf_model} to train on those" if self.prepared_data is not None else
                         f"hf_model={self.hf_model!r} (--hf-model): its weights train on the ids of tokenizer="
                         f"{self.tokenizer!r} (--tokenizer), not its own; leave --tokenizer out to train on those")
        if fresh_hf:
            notes += _eos_mismatch(self.hf_model, self.tokenizer)
        if self.hf_model is not None and not self.resume and _unreadable_generation_config(self.hf_model):
            notes.append(f"hf_model={self.hf_model!r} (--hf-model): its generation_config.json is not a JSON object; "
                         "training does not read it, and export --hf will write none")
        return notes

    def parallel_config(self) -> ParallelConfig:
        """The parallel options on their own, as the runtime takes them (`parallelize`)."""
        return ParallelConfig(**values_of(ParallelConfig, self))

    @property
    def layout(self) -> Layout:
        """The layout on its own, as the runtime takes it (`init_mesh`)."""
        return Layout(**values_of(Layout, self))

    def _check_checkpointing(self) -> None:
        _check_int("save_every", self.save_every, minimum=0)
        for name in ("save_every", "resume", "stop_after"):
            if getattr(self, name) and self.out is None:
                raise TrainConfigError(f"{name}={getattr(self, name)!r} ({_flag(name)}): needs --out DIR, "
                                       "where checkpoints live")
        if self.extend and not self.resume:
            raise TrainConfigError("extend=True (--extend): needs --resume; it extends a checkpointed run")
        if self.new_data and not (self.resume and self.data is not None):
            raise TrainConfigError("new_data=True (--new-data): needs --resume and the new --data; it accepts "
                                   "data that differs from the run's record")
        if self.overwrite and (self.out is None or self.resume):
            missing = "it needs --out: " if self.out is None else ""
            raise TrainConfigError(f"overwrite=True (--overwrite): {missing}for a new run into an --out folder that "
                                   "holds another run (not with --resume)")
        if self.stop_after >= self.steps:
            raise TrainConfigError(f"stop_after={self.stop_after} (--stop-after): the run ends at --steps="
                                   f"{self.steps} anyway; give a step before it")
        if self.out is not None:
            _check_out_folder(self.out)

    def _check_data(self) -> None:
        if self.data is None:
            return
        object.__setattr__(self, "data", tuple(str(p) for p in self.data))  # frozen: normalized once, here
        if not self.data:
            raise TrainConfigError("data=() (--data): give at least one file, or None for the stdlib corpus")
        if any(is_prepared_dataset(path) for path in self.data):
            if len(self.data) > 1:
                raise TrainConfigError(f"data={list(self.data)!r} (--data): a prepared dataset folder comes alone")
            try:
                read_meta(self.data[0])
            except ValueError as err:
                raise TrainConfigError(f"data={self.data[0]!r} (--data): {err}") from None
            return
        for path in self.data:
            if Path(path).is_dir():
                raise TrainConfigError(f"data={path!r} (--data): a folder, not a text file, and not a prepared "
                                       f"dataset (no dataset.json); give its files ({path}/*.txt, say) or "
                                       "tokenize them with `orangetron prepare-data`")
            if not Path(path).is_file():
                moved = "; a resume reads the data at the path its record holds: give --data with the path it has " \
                        "now (the data is compared by its text, not its path)" if self.resume else ""
                raise TrainConfigError(f"data={path!r} (--data): no such file{moved}")

    @property
    def prepared_data(self) -> str | None:
        """The prepared dataset folder `data` names, or None (text files, or the stdlib corpus)."""
        if self.data is not None and len(self.data) == 1 and is_prepared_dataset(self.data[0]):
            return self.data[0]
        return None

    def _resolve_packing(self) -> None:
        """Settle `pack_documents` (None: on for a prepared dataset, which keeps a document index) and check it."""
        pack = self.prepared_data is not None if self.pack_documents is None else bool(self.pack_documents)
        object.__setattr__(self, "pack_documents", pack)
        if not pack:
            return
        if self.prepared_data is None and self.tokenizer != "byte":
            # A resume restores packing from its record: the run trained on a prepared dataset, and is given text.
            resumed = (" (a resumed run keeps its record's packing: it trained on a prepared dataset, so new data "
                       "comes prepared, with --new-data)") if self.resume else ""
            raise TrainConfigError(f"pack_documents=True (--pack-documents): text files are cut into documents by "
                                   f"bytes, and tokenizer={self.tokenizer!r} is not the byte tokenizer; prepare the "
                                   f"data with `orangetron prepare-data`, which keeps a document index{resumed}")

    def _resolve_hf_model(self) -> None:
        """With `hf_model`, its config is the model: `model` becomes that spec (a resumed run's recorded spec stands
        when the folder is gone; a differing one is refused when the run resumes)."""
        if self.hf_model is None:
            return
        folder = Path(self.hf_model)
        if isinstance(self.model, ModelSpec) and self.resume and not folder.exists():
            return
        if not is_hf_folder(folder):
            why = ("no such folder" if not folder.exists() else
                   f"a file; give the folder that holds it ({folder.parent})" if folder.is_file() else
                   "not a Hugging Face model folder (no config.json)")
            raise TrainConfigError(f"hf_model={self.hf_model!r} (--hf-model): {why}")
        try:
            spec = spec_from_hf(read_hf_config(folder), folder.resolve().name)
            if not self.resume:  # a resumed run reads its weights from its checkpoint
                check_weight_files(folder)
        except (ValueError, FileNotFoundError) as err:
            raise TrainConfigError(f"hf_model={self.hf_model!r} (--hf-model): {err}") from None
        if isinstance(self.model, str) and self.model != _field_default("model"):
            raise TrainConfigError(f"model={self.model!r} (--model): --hf-model {self.hf_model} is the model; give "
                                   "one of them")
        object.__setattr__(self, "hf_model", str(folder.resolve()))  # frozen: normalized once, here
        if not isinstance(self.model, ModelSpec):
            object.__setattr__(self, "model", spec)

    def _resolve_tokenizer(self, model: ModelSpec) -> None:
        """Settle `tokenizer` (None: the prepared dataset's, else the hf_model folder's, else "byte") and check
        that its ids fit the model's vocabulary."""
        from orangetron.train.tokenizer import TOKENIZERS, has_tokenizer, tokenizer_named  # torch, as validation is

        prepared = read_meta(self.prepared_data) if self.prepared_data else None
        name, given = self.tokenizer, "--tokenizer"  # who gave it, for the errors below
        if name is None:
            if prepared is not None:
                name, given = prepared["tokenizer"], "--data, the prepared dataset's"
            elif self.hf_model is not None and has_tokenizer(self.hf_model):
                name, given = self.hf_model, "--hf-model, the folder's"
            else:
                name = "byte"
        if name not in TOKENIZERS:
            if not Path(name).exists() and self.resume:  # the record's, or a flag that must name the same
                raise TrainConfigError(f"tokenizer={name!r}: no such tokenizer; a resume reads the run's tokenizer at "
                                       "the path it recorded: restore it there, or give --tokenizer DIR after "
                                       f"`orangetron tokenizer export {self.out} -o DIR` writes the copy its "
                                       "checkpoint keeps")
            if not Path(name).exists():
                raise TrainConfigError(f"tokenizer={name!r} (--tokenizer): neither byte nor a tokenizer folder or "
                                       "tokenizer.json")
            name = str(Path(name).resolve())
        if prepared is not None:
            _check_dataset_tokenizer(name, prepared, self.prepared_data, self.out if self.resume else None)
        try:
            vocab = prepared["vocab_size"] if prepared is not None else tokenizer_named(name).vocab_size
        except ValueError as err:
            named = f"tokenizer={name!r}: "  # how the tokenizer's own errors begin: not said twice
            why = str(err).removeprefix(named)
            raise TrainConfigError(f"tokenizer={name!r} ({given}): {why}") from None
        if vocab > model.vocab_size:
            raise TrainConfigError(f"tokenizer={name!r} ({given}): {vocab} token ids, more than the model's "
                                   f"vocab_size={model.vocab_size}")
        object.__setattr__(self, "tokenizer", name)

    def model_config(self) -> ModelSpec:
        """The model this run trains: the given spec, or the preset or model file `model` names."""
        if isinstance(self.model, ModelSpec):
            return self.model
        if self.model in MODEL_PRESETS:
            return model_preset(self.model)
        folder = Path(self.model)
        if folder.is_dir() and not (folder / "config.json").is_file() and (folder / "config.toml").is_file():
            raise TrainConfigError(f"model={self.model!r} (--model): a run's folder, not a model: --config "
                                   f"{folder / 'config.toml'} repeats its run, --resume --out {folder} continues it")
        if self.model in preset_names() or self.model.endswith(".toml") or folder.exists():
            try:
                return load_decoder(self.model)
            except (ValueError, FileNotFoundError) as err:
                raise TrainConfigError(f"model={self.model!r} (--model): {err}") from None
        raise TrainConfigError(f"model={self.model!r} (--model): unknown preset; choose one of "
                               f"{', '.join(MODEL_PRESETS)}, a planner preset (orangetron presets) or a .toml file")

    def _check_model(self) -> None:
        model = self.model_config()
        try:
            check_runnable(model)
        except ConfigError as err:
            raise TrainConfigError(f"model={model.name!r} (--model): {err}") from None
        rules.ep_splits_experts(self.ep, model.num_experts, model.num_moe_layers)
        if self.seq_len > model.max_seq_len:  # before ranks start; a cp shard or a pipeline stage never checks it
            raise TrainConfigError(f"seq_len={self.seq_len} (--seq-len): longer than the model's max_seq_len="
                                   f"{model.max_seq_len}; give a shorter --seq-len, or a model made for longer "
                                   "sequences (max_seq_len in a model file, max_position_embeddings in a Hugging "
                                   "Face config)")

    def options(self) -> dict[str, object]:
        """The options that define this run, by flag name (as `--config` reads them back): everything but the
        model when it is a ModelSpec rather than a name, the fields without a flag (`WITHOUT_FLAGS`) left at
        their defaults, and a schedule span that is unset or `steps` (a resume sets it; an extension records the
        old one)."""
        layout, parallel = {f.name for f in fields(Layout)}, {f.name for f in fields(ParallelConfig)}
        out: dict[str, object] = {}
        # The run's own options first, then its layout, then its parallel options (the inherited fields come
        # first in `fields`).
        for field in sorted(fields(self), key=lambda f: (f.name in parallel, f.name in layout)):
            value = getattr(self, field.name)
            if isinstance(value, ModelSpec) or (field.name == "schedule_steps" and value in (None, self.steps)):
                continue
            if field.name in WITHOUT_FLAGS and value == field.default:
                continue
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out


def _unreadable_generation_config(folder: str) -> bool:
    """Whether `folder` holds a generation_config.json the run will not keep (`hf.folder.read_generation_config`)."""
    from orangetron.hf.folder import GENERATION_FILE, read_generation_config

    return (Path(folder) / GENERATION_FILE).is_file() and read_generation_config(folder) is None


def _eos_mismatch(folder: str, tokenizer: str | None) -> list[str]:
    """A note when the run's tokenizer ends documents with an EOS id that the --hf-model folder's generation
    settings do not end at (`hf.folder.eos_token_ids`): transformers' `generate` on an export would run past the
    end of a document. Nothing when either names no EOS."""
    from orangetron.hf.folder import eos_token_ids, read_generation_config
    from orangetron.spec.hf_config import read_config
    from orangetron.train.tokenizer import tokenizer_named

    eos = tokenizer_named(tokenizer).eos_id if tokenizer is not None else None
    ends = eos_token_ids(read_config(folder), read_generation_config(folder))
    if eos is None or not ends or eos in ends:
        return []
    return [f"hf_model={folder!r} (--hf-model): its generation settings end text at eos_token_id "
            f"{sorted(ends)}, but the tokenizer {tokenizer} ends documents with id {eos}: transformers' generate on "
            f"an export would not stop at a document's end (`orangetron sample` stops at both); set "
            f"eos_token_id in its config.json and generation_config.json to {eos}"]


def _same_ids(folder: str, tokenizer: str | None) -> bool:
    """Whether the tokenizer of `folder` and `tokenizer` give the same ids (`HFTokenizer.ids_sha256`)."""
    from orangetron.train.tokenizer import TOKENIZERS, tokenizer_named

    if tokenizer is None or tokenizer in TOKENIZERS:
        return False
    try:  # the folder's tokenizer is not the run's: one it cannot read is only not the same
        return tokenizer_named(folder).ids_sha256() == tokenizer_named(tokenizer).ids_sha256()
    except ValueError:
        return False


def _check_dataset_tokenizer(name: str, prepared: dict[str, Any], dataset: str | None, resumed: str | None) -> None:
    """The tokenizer must encode the ids the dataset was tokenized to: a tokenizer trained again into the same
    folder gives other ids for the same text (a rewritten file that keeps every id passes: `ids_sha256`; a
    dataset of 2026-12-04 holds the hash of the tokenizer's two files instead). One at another path passes
    where the dataset holds the hash of its ids and it encodes them (a copy, say); else it is refused. For a
    run resumed from folder `resumed` the fix named is the run's own tokenizer, which its checkpoints keep."""
    from orangetron.train.tokenizer import TOKENIZERS, tokenizer_named

    was = prepared["tokenizer"]
    if name != was and (name in TOKENIZERS or was in TOKENIZERS or "tokenizer_ids_sha256" not in prepared):
        raise TrainConfigError(f"tokenizer={name!r} (--tokenizer): the prepared dataset {dataset} was tokenized "
                               f"with {was!r}")
    if name in TOKENIZERS or not (prepared.get("tokenizer_ids_sha256") or prepared.get("tokenizer_sha256")):
        return
    tok = tokenizer_named(name)
    if "tokenizer_ids_sha256" in prepared:
        recorded, now = prepared["tokenizer_ids_sha256"], tok.ids_sha256()
    else:
        recorded, now = prepared["tokenizer_sha256"], tok.files_sha256()
    if now == recorded:
        return
    why = (f"its ids changed since the prepared dataset {dataset} was tokenized with it" if name == was else
           f"it encodes other ids than {was}, which the prepared dataset {dataset} was tokenized with")
    fix = "prepare the data again" if name == was else "give that tokenizer or a copy of it"
    if resumed is not None:  # the run learnt the ids of the tokenizer it started with; its checkpoints keep it
        fix = (f"a resumed run keeps the tokenizer it started with: give a copy of it (`orangetron tokenizer "
               f"export {resumed} -o DIR` writes one), and data prepared with it")
    raise TrainConfigError(f"tokenizer={name!r} (--tokenizer): {why} (sha256 {recorded[:12]} then, {now[:12]} now); "
                           f"{fix}")


def _field_default(name: str) -> object:
    return TrainConfig.__dataclass_fields__[name].default


def _check_out_folder(out: str) -> None:
    if not str(out).strip():  # Path("") is ".": an unset $RUN_DIR trained into whatever folder the job ran in
        raise TrainConfigError(f"out (--out): {out!r} is an empty path; give the run's folder (`.` for this one)")
    # The nearest existing ancestor must be a folder, or creating the run folder fails mid-setup.
    for path in (Path(out), *Path(out).absolute().parents):
        if path.exists():
            if not path.is_dir():
                raise TrainConfigError(f"out={out!r} (--out): {str(path)!r} is a file, not a folder")
            return


def floor_min_lr(options: dict[str, Any]) -> None:
    """`train`'s cosine floor where none is given (`min_lr` None): a tenth of the peak, so that it scales with
    --lr as the defaults do (`estimate --config` checks a file's rates with the same floor)."""
    if options.get("min_lr") is None and isinstance(options.get("lr"), (int, float)):
        options["min_lr"] = options["lr"] / 10


def check_numbers(options: dict[str, Any]) -> None:
    """The run's counts, rates and dtype each in range (`train`, and `estimate --config` for a file's values
    over the trainer's defaults); TrainConfigError naming the flag otherwise."""
    for name in ("tp", "cp", "pp", "dp", "ep", "microbatches", "virtual_stages", "steps", "seq_len", "batch_size",
                 "eval_batches", "corpus_bytes"):
        _check_int(name, options[name], minimum=1)
    for name in ("warmup", "eval_every", "seed", "stop_after"):
        _check_int(name, options[name], minimum=0)
    for name in ("schedule_steps", "threads"):  # None: unset
        if options[name] is not None:
            _check_int(name, options[name], minimum=1)
    timeout_s = options["timeout_s"]
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise TrainConfigError(f"timeout_s={timeout_s!r} (--timeout-s): must be a finite number > 0")
    for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            floor = "> 0" if name == "lr" else ">= 0"  # lr 0 is refused next, as > 0: one rule, said alike
            raise TrainConfigError(f"{name}={value!r} ({_flag(name)}): must be a finite number {floor}")
    if options["lr"] == 0 or options["min_lr"] > options["lr"]:
        raise TrainConfigError(f"lr={options['lr']} (--lr): must be > 0 and >= min_lr={options['min_lr']} (--min-lr)")
    if not 0.0 <= options["eval_fraction"] < 1.0:
        raise TrainConfigError(f"eval_fraction={options['eval_fraction']}: must be in [0, 1)")
    if options["param_dtype"] not in PARAM_DTYPES:
        raise TrainConfigError(f"param_dtype={options['param_dtype']!r} (--param-dtype): choose one of "
                               f"{', '.join(PARAM_DTYPES)}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise TrainConfigError(f"{name}={value!r} ({_flag(name)}): must be {rule}")
