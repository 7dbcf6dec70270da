"""The planner prices attention over packed documents (`estimate --doc-lengths FILE`): the busiest head-tail cp
rank's visible keys, counted here token by token in plain torch."""

from __future__ import annotations

import json

import pytest
import torch

from orangetron import cli
from orangetron.parallel.context.sharding import head_tail_indices
from orangetron.plan.compute import ATTN_BLOCK, causal_keys, document_keys


def brute_keys(lengths: list[int], seq: int, cp: int) -> float:
    """Per whole sequence the packed documents fill (lengths repeated until one is full), each query's keys:
    itself and the earlier tokens of its document in that sequence, plus half its piece's diagonal block less
    one (a block is computed whole); the busiest rank's mean per query, averaged over the sequences."""
    stream = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths * max(1, -(-seq // sum(lengths))))])
    busiest = []
    for w in range(stream.numel() // seq):
        ids = stream[w * seq:(w + 1) * seq]
        keys = torch.zeros(seq, dtype=torch.float64)
        for d in ids.unique():
            where = (ids == d).nonzero().flatten()
            n = where.numel()
            keys[where] = torch.arange(1, n + 1, dtype=torch.float64) + (min(n, ATTN_BLOCK) - 1) / 2
        ranks = [head_tail_indices(seq, cp, r) for r in range(cp)] if cp > 1 else [torch.arange(seq)]
        busiest.append(max(float(keys[r].sum()) for r in ranks))
    return sum(busiest) / len(busiest) / (seq // cp)


@pytest.mark.parametrize("cp", (1, 2, 4))
@pytest.mark.parametrize("lengths", [[1, 300, 17, 2000, 5, 700], [4096], [100] * 7, [3000, 40, 40, 200]])
def test_document_keys_are_the_busiest_ranks_visible_keys(cp, lengths):
    assert document_keys(tuple(lengths), 1024, cp) == pytest.approx(brute_keys(lengths, 1024, cp), rel=1e-12)


def test_one_document_per_sequence_is_the_causal_price_and_head_tail_loses_balance_on_documents():
    for cp in (1, 4):
        assert document_keys((4096,), 4096, cp) == causal_keys(4096)
    # A long document at the end: head-tail's tail chunks see most of it, so the busiest rank does more than
    # 1/cp of the work.
    lengths = (256,) * 8 + (2048,)
    mean = document_keys(lengths, 4096, 1)
    assert document_keys(lengths, 4096, 4) > 1.1 * mean


def test_estimate_prices_packed_documents_from_a_file(tmp_path, capsys):
    flags = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "4", "--cp", "2", "--seq", "4096", "--json"]
    assert cli.main(flags) == 0
    whole = json.loads(capsys.readouterr().out)
    (tmp_path / "lengths.txt").write_text("512 7\n64 8\n")
    assert cli.main([*flags, "--doc-lengths", str(tmp_path / "lengths.txt")]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert packed["time_breakdown_s"]["compute_s"] < whole["time_breakdown_s"]["compute_s"]
    assert packed["time_breakdown_s"]["cp_s"] == whole["time_breakdown_s"]["cp_s"]  # the same transfers
    (tmp_path / "bad.txt").write_text("512\n0\n")
    with pytest.raises(SystemExit):
        cli.main([*flags, "--doc-lengths", str(tmp_path / "bad.txt")])
    assert "bad.txt:2: expected LENGTH or LENGTH COUNT" in capsys.readouterr().err
