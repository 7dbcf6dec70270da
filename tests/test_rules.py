"""Every cross-field rule, walked: the CLI, the planner and the runtime refuse a violation with one message.

Each row of WALK names a rule of spec/rules.py, the message a user reads, and the violation as each caller
takes it: `train` and `estimate` flags (the CLI), a planner call and a runtime call. The model is the
`small-moe` preset everywhere (the planner reads it from a TOML file of the same shape), so the values in
the messages agree. A caller left out is one that never takes the option (the runtime refuses planner-only
options by name) or, for `train` with cp > 1, pads the sequence to whole chunks instead. A scan then checks
that no module outside the spec layer words a rule itself.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from orangetron.spec import rules
from orangetron.spec.layout import Layout
from orangetron.spec.options import Degrees, Job, validate

SRC = Path(__file__).resolve().parents[1] / "src" / "orangetron"


def _cfg():
    from orangetron.model.config import model_preset

    return model_preset("small-moe")


def _spec():
    return _cfg()  # the runtime's preset is the planner's spec too


def _plan(deg: Degrees, **job) -> None:
    validate(_spec(), deg, Job(**{"seq_len": 64, **job}))


def _parallel(**options) -> None:
    """The options as the runtime takes them: built (the shared rules), then checked runnable (its own)."""
    from orangetron.parallel.config import ParallelConfig, check_runnable

    check_runnable(ParallelConfig(**options))


@dataclass(frozen=True)
class Walk:
    rule: object  # the function in spec/rules.py
    message: str  # exactly what every caller prints
    train: tuple[str, ...] | None  # `orangetron train` flags, or None
    estimate: tuple[str, ...] | None  # `orangetron estimate` flags (the model file added), or None
    planner: object  # () -> None, raises
    runtime: object | None  # () -> None, raises; None: the runtime never takes the option
    phrase: str  # words of the message no module outside spec/ may hold


WALK = [
    Walk(rules.tp_splits_heads, "tp=3: n_heads=8 is not divisible by tp; the heads allow tp 1, 2, 4, 8", ("--tp", "3"),
         ("--tp", "3", "--dp", "1"), lambda: _plan(Degrees(tp=3)), lambda: Layout(tp=3).validate(_cfg()),
         "is not divisible by tp\""),
    Walk(rules.ep_splits_experts, "ep=3: n_experts=8 is not divisible by ep",
         ("--dp", "3", "--ep", "3", "--batch-size", "9"), ("--dp", "3", "--ep", "3"),
         lambda: _plan(Degrees(dp=3, ep=3)), lambda: Layout(dp=3, ep=3).validate(_cfg()), "is not divisible by ep\""),
    Walk(rules.ep_divides_dp_cp, "ep=2: dp*cp=1 (dp=1 x cp=1) is not divisible by ep; experts shard over the dp x "
         "cp ranks (a folded expert mesh, planner only, lifts this): give dp x cp a multiple of 2", ("--ep", "2"),
         ("--ep", "2", "--dp", "1"),
         lambda: Degrees(ep=2), lambda: Layout(ep=2), "experts shard over the dp x cp"),
    # train, estimate and plan's search pad such a sequence as the run does (tests/test_plan_to_train.py)
    Walk(rules.cp_splits_sequence, "cp=3: seq_len 64 is not divisible by 2*cp=6 (head-tail chunks, or slots of "
         "packed documents)", None, None, lambda: _plan(Degrees(cp=3)),
         lambda: Layout(cp=3).validate(seq_len=64), "(head-tail chunks)"),
    Walk(rules.sp_splits_shard, "tp=2: sequence_parallel needs seq_len/cp=63 divisible by tp",
         ("--tp", "2", "--sequence-parallel", "--seq-len", "63"),
         ("--tp", "2", "--dp", "1", "--sequence-parallel", "--seq", "63"),
         lambda: _plan(Degrees(tp=2), seq_len=63, sequence_parallel=True),
         lambda: Layout(tp=2).validate(seq_len=63, sequence_parallel=True), "sequence_parallel needs seq_len/cp"),
    Walk(rules.ulysses_degree_only_for_its_modes, "ulysses_degree=2: only cp_mode usp takes it, not 'ring'",
         ("--cp", "2", "--ulysses-degree", "2"), ("--cp", "2", "--dp", "1", "--ulysses-degree", "2"),
         lambda: _plan(Degrees(cp=2), ulysses_degree=2), lambda: _parallel(ulysses_degree=2), "only cp_mode usp"),
    Walk(rules.ulysses_degree_divides_cp, "ulysses_degree=2: must divide cp=3 (usp is Ulysses x ring)",
         ("--cp", "3", "--cp-mode", "usp", "--ulysses-degree", "2", "--seq-len", "96"),
         ("--cp", "3", "--dp", "1", "--cp-mode", "usp", "--ulysses-degree", "2", "--seq", "96"),
         lambda: _plan(Degrees(cp=3), seq_len=96, cp_mode="usp", ulysses_degree=2), "mesh", "(usp is Ulysses x ring)"),
    Walk(rules.heads_split_by_all_to_all, "cp=3: the Ulysses all-to-all splits heads over 3 ranks, and needs heads "
         "per tp rank (8) divisible by it and kv heads per tp rank (4) divisible by it or dividing it; these heads "
         "allow cp 1, 2, 4, 8",
         ("--cp", "3", "--cp-mode", "ulysses", "--seq-len", "96"),
         ("--cp", "3", "--dp", "1", "--cp-mode", "ulysses", "--seq", "96"),
         lambda: _plan(Degrees(cp=3), seq_len=96, cp_mode="ulysses"), "mesh", "divisible by it or dividing it"),
    Walk(rules.overlap_chunks_need_chunked_dispatcher, "ep_overlap_chunks=2 with dispatcher='capacity': chunked "
         "overlap is implemented for ragged only; use 1",
         ("--dp", "2", "--ep", "2", "--dispatcher", "capacity", "--ep-overlap-chunks", "2"),
         ("--dp", "2", "--ep", "2", "--dispatcher", "capacity", "--ep-overlap-chunks", "2"),
         lambda: _plan(Degrees(dp=2, ep=2), dispatcher="capacity", ep_overlap_chunks=2),
         lambda: _parallel(dispatcher="capacity", ep_overlap_chunks=2), "chunked overlap is implemented"),
    Walk(rules.node_dispatch_needs_whole_experts, "etp=2 with dispatcher 'deepep': the planner prices DeepEP over "
         "the EP group with whole experts per rank (etp 1)", None,
         ("--tp", "2", "--etp", "2", "--dp", "2", "--ep", "2", "--dispatcher", "deepep", "--sequence-parallel"),
         lambda: _plan(Degrees(tp=2, dp=2, ep=2, etp=2), dispatcher="deepep"), None, "with whole experts per rank"),
    Walk(rules.reserved_sms_need_node_dispatch, "ep_comm_sms_reserved needs dispatcher='deepep' (the one priced "
         "with its SMs), not 'ragged'", None, ("--dp", "1", "--ep-comm-sms-reserved"),
         lambda: Job(seq_len=64, ep_comm_sms_reserved=True), None, "the one priced with its SMs"),
    Walk(rules.virtual_stages_need_chunked_schedule, "virtual_stages=2: needs pp_schedule 'interleaved' (not "
         "'1f1b')", ("--pp", "2", "--virtual-stages", "2"),
         ("--pp", "2", "--dp", "1", "--virtual-stages", "2", "--pp-schedule", "1f1b"),
         lambda: _plan(Degrees(pp=2), virtual_stages=2), lambda: _parallel(virtual_stages=2),
         "needs pp_schedule 'interleaved'"),
    Walk(rules.microbatches_multiple_of_pp, "microbatches=3: the interleaved schedule needs a multiple of pp=2",
         ("--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3",
          "--batch-size", "6"),
         ("--pp", "2", "--dp", "1", "--virtual-stages", "2", "--global-batch", "3"),
         lambda: _plan(Degrees(pp=2), virtual_stages=2, pp_schedule="interleaved", global_batch=3),
         lambda: __import__("orangetron.spec.schedule").spec.schedule.actions(2, 3, "interleaved", 2),
         "schedule needs a multiple of pp"),
    Walk(rules.microbatches_at_least_pp, "microbatches=1: the zb-h1 schedule needs at least pp=2", None,
         ("--pp", "2", "--dp", "1", "--pp-schedule", "zb-h1", "--global-batch", "1"),
         lambda: _plan(Degrees(pp=2), pp_schedule="zb-h1", global_batch=1), None, "schedule needs at least pp"),
    Walk(rules.distributed_optimizer_zero_stage, "distributed_optimizer with zero_stage=2: the distributed optimizer "
         "is ZeRO-1 sharding with an eager all-gather; use zero_stage 0 or 1 with it",
         ("--dp", "2", "--zero-stage", "2", "--distributed-optimizer"),
         ("--dp", "2", "--zero-stage", "2", "--distributed-optimizer"),
         lambda: Job(seq_len=64, zero_stage=2, distributed_optimizer=True),
         lambda: _parallel(zero_stage=2, distributed_optimizer=True), "is ZeRO-1 sharding with an eager"),
    Walk(rules.zero3_reduce_every_microbatch_needs_zero3, "zero3_reduce_every_microbatch with zero_stage=0: only "
         "ZeRO-3 reduces unit by unit during backward; use zero_stage 3", ("--zero3-reduce-every-microbatch",),
         ("--dp", "1", "--zero3-reduce-every-microbatch"), lambda: Job(seq_len=64, zero3_reduce_every_microbatch=True),
         lambda: _parallel(zero3_reduce_every_microbatch=True), "reduces unit by unit during backward"),
    # The planner prices gradient buckets under ZeRO-3 (its Megatron rows use them); the runtime cannot run them.
    Walk(rules.grad_buckets_not_with_zero3, "grad_bucket_numel=100 with zero_stage=3: ZeRO-3 reduce-scatters each "
         "unit (transformer block) during backward, its own buckets; use 0",
         ("--dp", "2", "--zero-stage", "3", "--grad-bucket-numel", "100"), None, None,
         lambda: _parallel(zero_stage=3, grad_bucket_numel=100), "reduce-scatters each unit (transformer block)"),
    Walk(rules.recompute_layers_need_full, "recompute_layers=1 needs recompute='full', not 'none'", None,
         ("--dp", "1", "--recompute-layers", "1"), lambda: Job(seq_len=64, recompute_layers=1),
         lambda: _parallel(recompute_layers=1), "needs recompute='full'"),
    Walk(rules.fp8_recipe_needs_fp8, "fp8_recipe='blockwise' needs fp8=True", None,
         ("--dp", "1", "--fp8-recipe", "blockwise"), lambda: Job(seq_len=64, fp8_recipe="blockwise"), None,
         "needs fp8=True"),
]


def test_the_walk_covers_every_rule():
    assert [w.rule for w in WALK] == list(rules.RULES)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    spec = _spec()
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name != "name"}
    lines = [f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in values.items()]
    path = tmp_path_factory.mktemp("model") / "small-moe.toml"
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return str(path)


def _cli_error(argv: list[str], capsys) -> str:
    from orangetron.cli import main

    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _with_flag(message: str, command: str) -> str:
    """The rule's message as `command` words it: its leading field (and value) followed by the flag of the
    command's that sets it, where one does (estimate's micro-batches per step follow from the global batch)."""
    from orangetron.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = commands.choices[command]._option_string_actions
    head = re.split(r"[ :]", message, maxsplit=1)[0]
    field = head.split("=")[0]
    flag = "--" + field.replace("_", "-")
    if field == "microbatches" and flag not in options:
        flag = "--global-batch / (--micro-batch x dp)"
    elif flag not in options or (field == head and "_" not in field):
        return message
    return message.replace(head, f"{head} ({flag})", 1)


@pytest.mark.parametrize("walk", WALK, ids=lambda w: w.rule.__name__)
def test_every_caller_refuses_with_the_rule_message(walk, model_file, capsys):
    if walk.train is not None:
        got = _cli_error(["train", *walk.train], capsys)
        assert got == f"orangetron train: error: {_with_flag(walk.message, 'train')}"
    if walk.estimate is not None:
        got = _cli_error(["estimate", "--model", model_file, "--seq", "64", *walk.estimate], capsys)
        assert got == f"orangetron estimate: error: {_with_flag(walk.message, 'estimate')}"
    for caller in (walk.planner, walk.runtime):
        if callable(caller):
            with pytest.raises(rules.RuleError) as err:
                caller()
            assert str(err.value) == walk.message


def _mesh_rules(cfg) -> list[str]:
    """The rules the runtime can only check on a mesh (the cp group's size), on 3 cp ranks."""
    import torch

    from orangetron.mesh import init_mesh
    from orangetron.model import Transformer
    from orangetron.parallel.parallelize import context_parallel

    mesh, out = init_mesh(Layout(cp=3)), []
    for mode, degree in (("usp", 2), ("ulysses", 1)):
        try:
            context_parallel(Transformer(cfg, seed=0, dtype=torch.float64), mesh, mode, degree)
        except rules.RuleError as err:
            out.append(str(err))
    return out


def test_the_runtime_refuses_mesh_rules_with_the_same_message():
    from orangetron.testing import run_distributed

    walks = [w for w in WALK if w.runtime == "mesh"]
    assert run_distributed(_mesh_rules, 3, args=(_cfg(),))[0] == [w.message for w in walks]


def test_no_module_outside_the_spec_layer_words_a_rule():
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "spec":
            continue
        text = path.read_text()
        assert "RuleError(" not in text, f"{path} raises RuleError itself"
        for walk in WALK:
            assert walk.phrase not in text, f"{path} words the rule {walk.rule.__name__} itself"
