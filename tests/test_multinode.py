"""Two torchrun "nodes" on 127.0.0.1 (2 ranks each, gloo, c10d rendezvous): the same losses as the local
launcher, tp placed inside a node and said so, and a rank killed on one node ends the job on both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from orangetron import cli

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--model", "tiny", "--tp", "2", "--dp", "2", "--steps", "3", "--seq-len", "32", "--batch-size", "4",
         "--corpus-bytes", "60000", "--timeout-s", "10"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, fault: tuple[int, str], *argv: str) -> list[subprocess.CompletedProcess]:
    """Both nodes' torchrun agents, started together; `fault` (rank, kind) planted at step 2."""
    port, pids = _free_port(), tmp_path / "pids"
    pids.mkdir()
    rank, kind = fault
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
               str(ROOT / "tests" / "torchrun_fault.py"), str(rank), "2", kind, str(pids), "--", *TRAIN, *argv]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path) for _ in range(2)]
    done = []
    for node in nodes:  # the limit only keeps a broken build from hanging the suite
        out, err = node.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def test_two_nodes_train_as_the_local_launcher_with_tp_inside_a_node(tmp_path, capsys) -> None:
    assert cli.main([*TRAIN, "--quiet", "--json"]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    nodes = _two_nodes(tmp_path, (0, "none"), "--json")
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr[-3000:] + nodes[1].stderr[-3000:]
    printed = [json.loads(n.stdout.strip().splitlines()[-1]) for n in nodes if n.stdout.strip()]
    assert len(printed) == 1  # rank 0's node prints the merged result, once
    assert printed[0]["losses"] == local["losses"]  # bitwise: the same ranks, the same reductions
    assert printed[0]["layout"] == local["layout"]
    log = "".join(n.stderr for n in nodes)
    assert "placement: 2 node(s) of 2 ranks: tp inside a node; dp across nodes" in log


def test_a_rank_killed_on_one_node_ends_the_job_on_both_naming_it(tmp_path) -> None:
    start = time.monotonic()
    nodes = _two_nodes(tmp_path, (3, "kill"))
    elapsed = time.monotonic() - start
    assert all(n.returncode != 0 for n in nodes)
    log = "".join(n.stderr for n in nodes)
    assert "rank      : 3" in log or "rank 3" in log, log[-3000:]
    # Startup (two agents, four workers importing torch) plus the 10 s timeout; a loose bound for loaded machines.
    print(f"job ended {elapsed:.1f} s after it started")
    assert elapsed < 120, elapsed
    leftover = [p for p in (tmp_path / "pids").iterdir() if _alive(int(p.name))]
    assert leftover == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_verify_under_torchrun_speaks_once(tmp_path) -> None:
    """Every process holds the result; it was printed (and --json's object) once per rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "orangetron", "verify", "--dp", "2", "--model", "tiny", "--steps", "1", "--zero-stage", "3",
               "--sequence-parallel", "--json"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len([line for line in done.stdout.splitlines() if line.startswith("{")]) == 1, done.stdout
    assert done.stderr.count("orangetron verify: model tiny") == 1, done.stderr[-3000:]
    assert done.stderr.count("orangetron verify: warning: sequence_parallel=True") == 1  # a warning once too
