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
