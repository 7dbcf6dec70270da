"""The memory-overhead term: fixed GiB (context and one communicator per mesh group) plus a share of the
dynamic allocations. Expected values are worked by hand from the documented constants."""

import json

import pytest

from orangetron.cli import main as run
from orangetron.plan.overhead import (
    DEFAULT_OVERHEAD,
    NO_OVERHEAD,
    MemoryOverhead,
    OverheadError,
    fits,
    fixed_overhead,
    with_overhead,
)
from orangetron.spec.options import Degrees

GIB = 1024**3


def test_default_counts_context_and_one_communicator_per_group():
    # tp=8, pp=4, dp=2: groups tp, pp, dp_cp (cp=1, ep=1, edp = dp_cp counted too) -> tp, pp, dp_cp, edp = 4
    deg = Degrees(tp=8, pp=4, dp=2)
    assert DEFAULT_OVERHEAD.fixed_bytes(deg) == int((1.0 + 0.5 * 4) * GIB)
    assert DEFAULT_OVERHEAD.fixed_bytes(Degrees()) == 1 * GIB  # one GPU: the context only


def test_fraction_applies_to_activations_and_buffers_only():
    memory = {"params": 10 * GIB, "grads": 20 * GIB, "activations": 8 * GIB, "buffers": 2 * GIB, "total": 40 * GIB}
    out = with_overhead(memory, Degrees(), MemoryOverhead(context_gib=1.0, per_group_gib=0.5, fraction=0.15))
    assert out["overhead"] == 1 * GIB + int(0.15 * 10 * GIB)  # 2.5 GiB
    assert out["total"] == 40 * GIB + out["overhead"]
    assert memory["total"] == 40 * GIB  # the tensor breakdown is left as it was


def test_fit_check_counts_the_pressured_share_not_the_reserved_one():
    """`needed` = tensors + fixed + the pressured share of activations and buffers, and the fit check reads it: a
    limit between `needed` and `total` fits. The share is never more than the reserved fraction."""
    memory = {"params": 10 * GIB, "grads": 20 * GIB, "activations": 8 * GIB, "buffers": 2 * GIB, "total": 40 * GIB}
    setting = MemoryOverhead(context_gib=1.0, per_group_gib=0.5, fraction=0.15, pressured_fraction=0.05)
    out = with_overhead(memory, Degrees(), setting)
    assert out["needed"] == 40 * GIB + 1 * GIB + int(0.05 * 10 * GIB)  # 41.5 GiB
    assert out["total"] == 40 * GIB + 1 * GIB + int(0.15 * 10 * GIB)  # 42.5 GiB
    assert fits(out, out["needed"]) and fits(out, 42 * GIB) and not fits(out, out["needed"] - 1)
    capped = with_overhead(memory, Degrees(), MemoryOverhead(context_gib=1.0, fraction=0.15, pressured_fraction=0.3))
    assert capped["needed"] == capped["total"]
    assert with_overhead(memory, Degrees(tp=8), fixed_overhead(3.0, 0.0))["needed"] == 43 * GIB


def test_fixed_setting_ignores_the_layout_and_zero_turns_it_off():
    setting = fixed_overhead(3.0, 0.0)
    assert setting.fixed_bytes(Degrees(tp=8, dp=16)) == 3 * GIB
    memory = {"activations": 5 * GIB, "total": 5 * GIB}
    assert with_overhead(memory, Degrees(tp=8), NO_OVERHEAD)["total"] == 5 * GIB


@pytest.mark.parametrize(("field", "value"), [("context_gib", -1.0), ("fraction", 1.5), ("per_group_gib", -0.1),
                                             ("pressured_fraction", 1.0), ("pressured_fraction", -0.01)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(OverheadError, match=field):
        MemoryOverhead(**{field: value})


def test_cli_flags(capsys):
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--sequence-parallel", "--json"]
    assert run([*argv, "--overhead-gib", "0", "--overhead-fraction", "0"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory_bytes"]
    assert plain["overhead"] == 0
    assert run([*argv, "--overhead-gib", "2", "--overhead-fraction", "0.5"]) == 0
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory_bytes"]
    # The fraction applies to what is allocated and freed every step: activations and the transient buffers
    # (here the bf16 wire copy of the fp32 main gradients).
    assert plain["buffers"] > 0
    assert mem["overhead"] == 2 * GIB + int(0.5 * (plain["activations"] + plain["buffers"]))
    assert mem["total"] == plain["total"] + mem["overhead"]
    assert run([*argv, "--overhead-fraction", "-1"]) == 2
    assert "fraction=-1.0" in capsys.readouterr().err
