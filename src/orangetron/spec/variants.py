"""Variants registered once: each context-parallel mode, expert dispatcher and pipeline schedule is one record.

A record holds the variant's name, its runtime as an import path resolved on first use (so `--help` and the
planner never import torch; None: the planner prices it but the runtime does not run it), its torch-free costs
(the ledger records it issues, the bytes it saves for backward, what of its traffic overlaps compute) and its
layout checks. The planner sums what the records say, the runtime calls what they name, and the CLI takes its
choices from `names()`. The built-in records live in `context_modes.py`, `dispatchers.py` and `schedules.py`.

Plugins add variants from outside the package: every module named in the environment variable
`ORANGETRON_PLUGINS` (comma-separated) and every entry point of the group `orangetron.plugins` is imported the
first time a registry is read, in every process: `train --help` subprocesses and the ranks a launcher starts
see the same variants. A plugin module registers its records at import:

    from orangetron.spec.variants import CONTEXT_MODES, ContextMode
    CONTEXT_MODES.register(ContextMode(name="my-mode", runtime="my_package.my_mode", records=...))
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar

from orangetron.spec.rules import RuleError

PLUGINS_ENV = "ORANGETRON_PLUGINS"
ENTRY_POINT_GROUP = "orangetron.plugins"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # what a command-line choice can be


@dataclass(frozen=True)
class Variant:
    """What every variant record has: a name, a one-line summary and where its runtime lives."""

    name: str
    summary: str = ""
    # "package.module" (or "package.module:attribute"), imported on first use; None: planner only
    runtime: str | None = None

    def load(self) -> Any:
        """The runtime object the import path names; a path that names nothing is refused in one line."""
        module_name, _, attribute = self.runtime.partition(":")
        try:
            module = importlib.import_module(module_name)
            return getattr(module, attribute) if attribute else module
        except (ImportError, AttributeError) as err:
            raise RuleError(f"{self.name!r}: its runtime {self.runtime!r} cannot be loaded ({err})") from None

    def check_usable(self) -> None:
        """Refuse a record that cannot work: a name the command line cannot give, or a cost left at its default
        where the planner needs it (each kind says which, `_missing`)."""
        if not NAME.fullmatch(self.name):
            raise RuleError(f"{self.name!r}: a variant's name is letters, digits and . _ + - (not starting with "
                            "one of these), as a command-line choice")
        missing = self._missing()
        if missing:
            raise RuleError(f"{self.name!r}: {missing}")

    def _missing(self) -> str:
        return ""


def _given(record: Variant, field: str, kind: type) -> bool:
    """Whether `record` sets `field` rather than keeping the default of its `kind` (a subclass's own default
    counts as set)."""
    return getattr(record, field) is not kind.__dataclass_fields__[field].default


V = TypeVar("V", bound=Variant)


class Registry(Generic[V]):
    """The records of one kind of variant, by name, in registration order (built-ins first)."""

    def __init__(self, field: str, builtins: str) -> None:
        self.field = field  # the option that names a variant of this kind, e.g. "cp_mode"
        self._builtins = builtins  # the module that registers the built-in records
        self._records: dict[str, V] = {}
        self._origins: dict[str, str] = {}  # by name: the module that registered it
        self._loaded = False

    def register(self, record: V) -> V:
        """Add `record` (`Variant.check_usable`); a second record of the same name is refused, naming the first's
        module. Plugins are not loaded here: the built-in module registers through this while it imports, and a plugin
        may read any built-in record."""
        self._import_builtins()
        record.check_usable()
        origin = _caller_module()
        if record.name in self._records:
            raise RuleError(f"{self.field}={record.name!r}: a variant of that name is already registered (by "
                            f"{self._origins[record.name]}); {origin} cannot register another")
        self._records[record.name] = record
        self._origins[record.name] = origin
        return record

    @contextmanager
    def temporarily(self, record: V) -> Iterator[V]:
        """`record` registered for the length of a `with` block, then removed (tests keep the registry as
        they found it)."""
        self.register(record)
        try:
            yield record
        finally:
            del self._records[record.name]

    def __getitem__(self, name: str) -> V:
        self._load()
        if name not in self._records:
            raise RuleError(f"{self.field}={name!r}: must be one of {', '.join(self._records)}")
        return self._records[name]

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._records

    def __iter__(self) -> Iterator[V]:
        self._load()
        return iter(list(self._records.values()))

    def names(self, runtime: bool = False) -> tuple[str, ...]:
        """Every registered name, or with `runtime` only those the runtime runs."""
        return tuple(r.name for r in self if r.runtime is not None or not runtime)

    def runtime_record(self, name: str) -> V:
        """The record of `name`, refused in one line when the runtime does not run it."""
        if name not in self:
            raise RuleError(f"{self.field}={name!r}: must be one of {', '.join(self.names(runtime=True))}")
        record = self[name]
        if record.runtime is None:
            raise RuleError(f"{self.field}={name!r}: priced by the planner only; the runtime runs "
                            f"{', '.join(self.names(runtime=True))}")
        return record

    def _import_builtins(self) -> None:
        importlib.import_module(self._builtins)  # while it imports, the module it has so far: it registers here

    def _load(self) -> None:
        """Every kind's built-ins, then the plugins (once per process), before the first read."""
        if self._loaded:
            return
        self._loaded = True  # before the imports: they register into this registry
        for registry in (CONTEXT_MODES, DISPATCHERS, SCHEDULES):
            registry._import_builtins()
        load_plugins()


def _caller_module() -> str:
    """The module that called `Registry.register` (through `temporarily`, the test's)."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


_PLUGINS_LOADED: set[str] = set()  # process-wide by design: a plugin registers its variants once per process


def load_plugins() -> None:
    """Import every plugin module named by `ORANGETRON_PLUGINS` and the `orangetron.plugins` entry points."""
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        if name not in _PLUGINS_LOADED:
            try:
                importlib.import_module(name)
            except ImportError as err:  # a typo or a folder off the path: one line, not a traceback
                missing = getattr(err, "name", None) or ""
                if not (missing and (name == missing or name.startswith(missing + "."))):  # found; its import failed
                    raise ValueError(f"{PLUGINS_ENV}={os.environ[PLUGINS_ENV]!r}: plugin {name!r} was found but its "
                                     f"own import failed ({err})") from None
                raise ValueError(f"{PLUGINS_ENV}={os.environ[PLUGINS_ENV]!r}: cannot import plugin {name!r} ({err}); "
                                 "correct the name or put its folder on PYTHONPATH") from None
            _PLUGINS_LOADED.add(name)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.value not in _PLUGINS_LOADED:
            _PLUGINS_LOADED.add(entry.value)
            entry.load()


# ---- the three kinds ------------------------------------------------------------------------------------
# Cost functions take the spec's own objects: `ModelSpec` (model), `Layout` (deg), `Job` (job), and for saved
# bytes the planner's per-layer shape `x` (tokens s, batch b, key length s_kv, dtype bytes a, accumulator bytes
# acc; see plan/activations.py `LayerShape`).
RecordsFn = Callable[..., list]


@dataclass(frozen=True)
class ContextMode(Variant):
    """A context-parallel attention mode. Its runtime is a module with `attention(q, k, v, group, causal, scale)`
    over its cp group, and optionally `cp_group(mesh, ulysses_degree)` when that group is not `mesh["cp"]`."""

    # (model, deg, job, forward_passes) -> the CP records of one layer and micro-batch, forward + backward
    records: RecordsFn = lambda model, deg, job, passes: []
    # (model, x, job, heads, kv_heads) -> bytes one layer saves beyond q, k, v and the output
    saved_bytes: Callable[..., int] = lambda model, x, job, heads, kv_heads: 0
    keeps_kernel_state: bool = True  # False: it keeps its own softmax state instead of the kernel's lse or scores
    # (deg, job) -> key blocks per kernel call: each call sees seq/blocks keys (a ring passes cp blocks)
    key_blocks: Callable[..., int] = lambda deg, job: 1
    # (cp, ulysses_degree) -> ranks the heads are split over by all-to-all (1: heads stay whole)
    head_split: Callable[[int, int], int] = lambda cp, ulysses_degree: 1
    # Ops of its records that run behind the attention blocks (the rest come before the attention needing them)
    overlapped_ops: tuple[str, ...] = ("send_recv",)
    # (deg, job) -> extra planner groups it talks over: name -> (ranks, stride in cp); none for plain "cp"
    subgroups: Callable[..., dict[str, tuple[int, int]]] = lambda deg, job: {}
    takes_ulysses_degree: bool = False  # the `ulysses_degree` option applies to it
    searched: bool = True  # `plan` tries it (usp needs a degree of its own; rsa never beats ring)
    # (deg, job) -> (cp ranks per ring member, the ring's planner group) for a mode whose K,V ring skips, over
    # packed documents, the blocks no later member sees (plan/traffic.py); None: priced as one sequence
    packed_ring: Callable[..., tuple[int, str]] | None = None

    def _missing(self) -> str:
        return "" if _given(self, "records", ContextMode) else "a cp mode names the records of its traffic (`records`)"

    @property
    def head_split_field(self) -> str:
        """The option whose value is the head split's degree, for a refusal to name."""
        return "ulysses_degree" if self.takes_ulysses_degree else "cp"


@dataclass(frozen=True)
class Dispatcher(Variant):
    """An expert dispatcher. Its runtime is a module with `dispatch(x, topk_idx, topk_weights, group,
    num_experts, options)` and `combine(expert_out, handle, group)` (see parallel/expert/dispatcher.py)."""

    # (model, deg, job, tokens) -> the EP records of one MoE layer and micro-batch, forward + backward, for a
    # rank routing `tokens`; a node-aware dispatcher's come from its placement (plan/node_dispatch.py)
    records: RecordsFn = lambda model, deg, job, tokens: []
    # (model, tokens, job, ep) -> rows one rank sends (and receives, on balance) for its `tokens`
    rows: Callable[..., int] = lambda model, tokens, job, ep: tokens * model.routed_ranks(ep)
    # (model, tokens, job, ep, rows) -> bytes of the slot mask it keeps for backward
    mask_bytes: Callable[..., int] = lambda model, tokens, job, ep, rows: rows * model.top_k
    chunked: bool = False  # runs `ep_overlap_chunks` > 1 (token chunks overlapping the experts)
    node_aware: bool = False  # priced from the EP group's node placement; needs whole experts (etp 1)
    # Pads every expert to capacity_factor x its fair share (capacity slots): ranks compute equal padded loads
    pads: bool = False

    def _missing(self) -> str:
        if self.node_aware or _given(self, "records", Dispatcher):  # a node-aware one is priced from its placement
            return ""
        return "a dispatcher names the records of its traffic (`records`), unless it is node-aware"


@dataclass(frozen=True)
class Schedule(Variant):
    """A pipeline schedule. Its runtime is the executor that plays its action lists (parallel/pipeline/)."""

    # (pp, microbatches, virtual_stages) -> each rank's ordered actions (spec/schedule.py `Action`); the
    # executor runs them as listed, so any order whose sends and receives pair up runs
    actions: Callable[..., list] = lambda pp, m, v: []
    chunks: bool = False  # takes virtual_stages > 1
    split_backward: bool = False  # B (input gradient) and W (weight gradient) run apart
    # (pp, microbatches) -> raises RuleError when the micro-batch count does not suit it (spec/rules.py)
    check: Callable[[int, int], None] = lambda pp, m: None
    # (pp, virtual_stages, microbatches, stage) -> the stage's peak micro-batches in flight, in units of its
    # layers; None: read off its action lists (spec/schedule.py `peak_held`)
    in_flight: Callable[..., float] | None = None
    # (pp, microbatches) -> micro-batches whose last-stage output and loss wait for their backward; None: read
    # off the last rank's actions of the last chunk
    held_outputs: Callable[[int, int], int] | None = None

    def _missing(self) -> str:
        return "" if _given(self, "actions", Schedule) else "a schedule lists each rank's actions (`actions`)"


CONTEXT_MODES: Registry[ContextMode] = Registry("cp_mode", "orangetron.spec.context_modes")
DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher", "orangetron.spec.dispatchers")
SCHEDULES: Registry[Schedule] = Registry("pp_schedule", "orangetron.spec.schedules")
