"""Variants registered from outside the package reach every command, and are exact and accounted.

tests/variants_plugin.py registers a cp mode, a dispatcher and a pipeline schedule through the documented hook
(the environment variable ORANGETRON_PLUGINS, read in every process, so `train --help` subprocesses and the
ranks a launch starts see them too). No file of the package names them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PLUGINS = {"cp_mode": "allgather-split", "dispatcher": "allgather-fixed", "pp_schedule": "eager-1f1b"}


def _env(plugins: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ORANGETRON_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    if plugins:
        env["ORANGETRON_PLUGINS"] = "variants_plugin"
    return env


def _run(args: list[str], plugins: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(plugins), capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS)


# One process prices every command through the CLI's own entry point: one JSON line per command.
_ESTIMATES = """
import contextlib, io, json, sys
from orangetron.cli import main
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, argv
    print(out.getvalue().strip().splitlines()[-1])
"""


def _estimates(commands: list[list[str]]) -> list[dict]:
    done = _run(["-c", _ESTIMATES, json.dumps(commands)])
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _variant_commands(flag: str, names: list[str], layout: list[str]) -> list[list[str]]:
    """An estimate per variant name; a schedule that interleaves model chunks gets two a rank."""
    return [["estimate", *layout, f"--{flag.replace('_', '-')}", name, "--json",
             *(["--virtual-stages", "2"] if flag == "pp_schedule" and name == "interleaved" else [])]
            for name in names]


def test_train_help_lists_the_plugins_only_when_the_hook_names_them():
    with_hook = _run(["-m", "orangetron", "train", "--help"])
    without = _run(["-m", "orangetron", "train", "--help"], plugins=False)
    assert with_hook.returncode == 0 and without.returncode == 0
    for name in PLUGINS.values():
        assert name in with_hook.stdout, name
        assert name not in without.stdout, name


def test_each_plugin_costs_differ_from_every_built_in_in_estimate():
    from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

    cases = {"cp_mode": (CONTEXT_MODES, ["--model", "llama3-8b", "--cp", "4", "--dp", "2", "--seq", "16384"]),
             "dispatcher": (DISPATCHERS, ["--model", "mixtral-8x7b", "--ep", "8", "--dp", "8"]),
             "pp_schedule": (SCHEDULES, ["--model", "llama3-8b", "--pp", "4", "--dp", "2", "--global-batch", "16"])}
    for field, (registry, layout) in cases.items():
        names = [*registry.names(), PLUGINS[field]]
        results = _estimates(_variant_commands(field, names, layout))
        priced = {r["job"][field]: (r["memory_bytes"], r["comm"]) for r in results}
        assert set(priced) == set(names)
        plugin = priced.pop(PLUGINS[field])
        for name, cost in priced.items():
            assert cost != plugin, f"{PLUGINS[field]} costs what {name} does"


def test_plan_searches_the_plugins():
    commands = [["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "1", "--cp", "2", "--pp", "1", "--top", "500",
                 "--json"],
                ["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--dispatcher", PLUGINS["dispatcher"], "--ep", "2",
                 "--top", "3", "--json"],
                ["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "4", "--pp", "2", "--pp-schedule",
                 PLUGINS["pp_schedule"], "--top", "3", "--json"]]
    ranked = [r["ranked"] for r in _estimates(commands)]
    assert PLUGINS["cp_mode"] in {row["job"]["cp_mode"] for row in ranked[0]}
    assert {row["job"]["dispatcher"] for row in ranked[1]} == {PLUGINS["dispatcher"]}
    assert {row["job"]["pp_schedule"] for row in ranked[2]} == {PLUGINS["pp_schedule"]}


def test_verify_runs_each_plugin_exactly():
    for flags in (["--cp", "2", "--cp-mode", PLUGINS["cp_mode"], "--model", "tiny"],
                  ["--dp", "2", "--ep", "2", "--dispatcher", PLUGINS["dispatcher"]],
                  ["--pp", "2", "--microbatches", "4", "--pp-schedule", PLUGINS["pp_schedule"], "--model", "tiny"]):
        done = _run(["-m", "orangetron", "verify", *flags, "--param-dtype", "float64", "--steps", "2", "--json"])
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.splitlines()[-1])
        assert result["ok"] and result["max_loss_rel_diff"] < 1e-9 and result["max_grad_rel_diff"] < 1e-9, flags


def test_plugins_match_one_device_and_their_registered_costs():
    done = _run([str(TESTS / "plugin_checks.py")], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 3, done.stdout


def test_a_plugin_reads_a_built_in_record_whichever_module_imports_the_registry_first(tmp_path):
    """A dispatcher plugin that copies a built-in's costs when it loads found the registry empty: the built-in
    module's first registration loaded the plugins before the module's other built-ins were registered
    (`dispatcher='allgather': must be one of `, with nothing listed), and `--help` listed the plugin first."""
    (tmp_path / "copying_plugin.py").write_text(
        "from orangetron.spec.variants import DISPATCHERS, Dispatcher\n"
        "DISPATCHERS.register(Dispatcher(name='allgather-copy', runtime='orangetron.parallel.expert.allgather',\n"
        "                                records=DISPATCHERS['allgather'].records))\n")
    env = {**_env(plugins=False), "ORANGETRON_PLUGINS": "copying_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), _env(plugins=False)["PYTHONPATH"]])}
    script = ("import orangetron.plan.activations\n"  # imports the dispatchers' module first, as the CLI does
              "from orangetron.spec.variants import DISPATCHERS\n"
              "print(','.join(DISPATCHERS.names()))\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ragged,capacity,allgather,deepep,allgather-copy"]
    flags = ["estimate", "--model", "tiny-moe", "--gpus", "2", "--ep", "2", "--json", "--dispatcher"]
    priced = [subprocess.run([sys.executable, "-m", "orangetron", *flags, name], env=env, capture_output=True,
                             text=True, timeout=120) for name in ("allgather", "allgather-copy")]
    assert [p.returncode for p in priced] == [0, 0], priced[1].stderr
    copy, built_in = (json.loads(p.stdout.splitlines()[-1])["comm_bytes"] for p in reversed(priced))
    assert copy == built_in and any(key.endswith("/ep") for key in copy)


def test_a_record_that_cannot_work_is_refused_when_it_registers():
    """A schedule without actions crashed the planner (IndexError in plan/activations.py), a cp mode without
    records was priced as sending nothing (the closing table then read `predicted 0 / measured 32,768`), and
    names no command line can give ('' or 'has space') were listed in --help."""
    import dataclasses

    import pytest

    from orangetron.spec.rules import RuleError
    from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES, ContextMode, Dispatcher, Schedule

    refusals = [(SCHEDULES, Schedule(name="empty", runtime="x"), "a schedule lists each rank's actions"),
                (CONTEXT_MODES, ContextMode(name="silent", runtime="x"), "a cp mode names the records"),
                (DISPATCHERS, Dispatcher(name="silent", runtime="x"), "a dispatcher names the records"),
                (CONTEXT_MODES, ContextMode(name="", records=lambda *a: []), "a variant's name is letters"),
                (CONTEXT_MODES, ContextMode(name="has space", records=lambda *a: []), "a variant's name is letters"),
                (CONTEXT_MODES, ContextMode(name="ring", records=lambda *a: []),
                 r"already registered \(by orangetron.spec.context_modes\); (tests\.)?test_plugins cannot")]
    for registry, record, why in refusals:
        with pytest.raises(RuleError, match=why):
            registry.register(record)
    assert "silent" not in DISPATCHERS and "empty" not in SCHEDULES
    with DISPATCHERS.temporarily(Dispatcher(name="node-wise", node_aware=True)):  # priced from its placement
        assert "node-wise" in DISPATCHERS

    @dataclasses.dataclass(frozen=True)
    class OwnDefault(Schedule):  # a kind of the plugin's own whose default lists actions
        actions: object = lambda pp, m, v: [[] for _ in range(pp)]

    with SCHEDULES.temporarily(OwnDefault(name="own-default")):
        assert "own-default" in SCHEDULES
    with pytest.raises(RuleError, match=r"'missing': its runtime 'no_such_module_xyz' cannot be loaded \(No module"):
        Schedule(name="missing", runtime="no_such_module_xyz", actions=lambda *a: [[]]).load()
    with pytest.raises(RuleError, match=r"runtime 'orangetron.spec.variants:nothing' cannot be loaded"):
        Schedule(name="missing", runtime="orangetron.spec.variants:nothing").load()


def test_a_plugin_whose_own_import_fails_is_not_called_missing(tmp_path):
    (tmp_path / "broken_plugin.py").write_text("import no_such_dependency_abc\n")
    env = {**_env(plugins=False), "ORANGETRON_PLUGINS": "broken_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), _env(plugins=False)["PYTHONPATH"]])}
    done = subprocess.run([sys.executable, "-m", "orangetron", "presets"], env=env, capture_output=True, text=True,
                          timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert "plugin 'broken_plugin' was found but its own import failed (No module named 'no_such_dependency_abc')" \
        in err and "PYTHONPATH" not in err


def test_a_plugin_path_missing_a_middle_package_is_called_missing(monkeypatch):
    """`os.nothere.x` was said to be found with its own import failing: the missing `os.nothere` is its path."""
    import pytest

    from orangetron.spec import variants

    monkeypatch.setenv("ORANGETRON_PLUGINS", "os.nothere.x")
    with pytest.raises(ValueError, match=r"cannot import plugin 'os.nothere.x' \(No module named 'os.nothere'"):
        variants.load_plugins()
