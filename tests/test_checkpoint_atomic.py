"""Overwriting a checkpoint survives a crash at every point of the write.

A crash is simulated by raising at the n-th filesystem step of `save_checkpoint` (each tensor box written by
torch.distributed.checkpoint, its pickled metadata, state.json and the manifest, each fsync, each rename, the
clean-up), for every n until a save completes. After each crash the checkpoint of that
step must load bitwise equal to the old one (or to the new one once it is in place), and a partial
staging folder must never be picked.
"""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from orangetron.train import checkpoint
from orangetron.train.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint


class Crash(Exception):
    """The process dies here."""


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(7, 3, generator=g, dtype=torch.float64), "b": torch.randn(5, generator=g),
            "step": 4, "losses": [float(seed), 0.5]}


def same_bits(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if torch.is_tensor(x):
            if not (torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape
                    and x.numpy().tobytes() == y.numpy().tobytes()):
                return False
        elif x != y:
            return False
    return True


class Injector:
    """Counts filesystem steps of a save and raises `Crash` before step number `crash_at`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, crash_at: int) -> None:
        self.crash_at, self.steps, self.new_in_place, self.final = crash_at, 0, False, None
        targets = [(torch, "save"), (pickle, "dump"), (checkpoint, "_write_json"), (checkpoint, "_fsync"),
                   (os, "replace"), (shutil, "rmtree")]
        for owner, name in targets:
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, real, name):
        def step(*args, **kwargs):
            if self.steps == self.crash_at:
                raise Crash(f"before {name} (step {self.steps})")
            self.steps += 1
            out = real(*args, **kwargs)
            if name == "replace" and Path(args[1]) == self.final:
                self.new_in_place = True
            return out
        return step


def crash_points(overwrite: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Yield (folder, injector, crashed) for a save crashing at each step in turn, then one that completes."""
    for crash_at in range(100):
        folder = tmp_path / f"{'overwrite' if overwrite else 'fresh'}-{crash_at}"
        save_checkpoint(folder, 2, state(2))
        if overwrite:
            save_checkpoint(folder, 4, state(40))
        with monkeypatch.context() as patch:
            injector = Injector(patch, crash_at)
            injector.final = checkpoint_dir(folder, 4)
            try:
                save_checkpoint(folder, 4, state(41))
                crashed = False
            except Crash:
                crashed = True
        yield folder, injector, crashed
        if not crashed:
            assert crash_at >= 9, "two boxes, the metadata, two JSON files with an fsync each, a rename and fsyncs"
            return
    raise AssertionError("save_checkpoint never completed")


def test_overwrite_never_loses_the_previous_checkpoint(tmp_path, monkeypatch):
    for folder, injector, crashed in crash_points(True, tmp_path, monkeypatch):
        where = f"crash at step {injector.crash_at}" if crashed else "no crash"
        path = latest_checkpoint(folder)
        assert path is not None and ".partial-" not in path.name, where
        expected = state(41) if injector.new_in_place else state(40)
        assert same_bits(load_checkpoint(path), expected), where
        assert not crashed or not injector.new_in_place or path == checkpoint_dir(folder, 4), where
        # The next save of the same step completes and clears whatever the crash left aside.
        save_checkpoint(folder, 4, state(42))
        assert latest_checkpoint(folder) == checkpoint_dir(folder, 4), where
        assert same_bits(load_checkpoint(checkpoint_dir(folder, 4)), state(42)), where
        assert not list(folder.glob(".step-00000004.old-*")), where


def test_crashed_first_save_of_a_step_falls_back_to_the_previous_step(tmp_path, monkeypatch):
    for folder, injector, crashed in crash_points(False, tmp_path, monkeypatch):
        where = f"crash at step {injector.crash_at}" if crashed else "no crash"
        path = latest_checkpoint(folder)
        if injector.new_in_place:
            assert path == checkpoint_dir(folder, 4) and same_bits(load_checkpoint(path), state(41)), where
        else:  # the staging folder of step 4 is never picked, however complete it looks
            assert path == checkpoint_dir(folder, 2) and same_bits(load_checkpoint(path), state(2)), where


def test_a_complete_checkpoint_left_aside_is_found_and_a_staging_folder_is_not(tmp_path):
    save_checkpoint(tmp_path, 3, state(3))
    old = save_checkpoint(tmp_path, 4, state(40))
    os.replace(old, tmp_path / ".step-00000004.old-1234abcd")  # what a crash between the two renames leaves
    staged = save_checkpoint(tmp_path / "elsewhere", 5, state(5))
    os.replace(staged, tmp_path / ".step-00000005.partial-1234abcd")  # complete files, never renamed in
    path = latest_checkpoint(tmp_path)
    assert path == tmp_path / ".step-00000004.old-1234abcd"
    assert same_bits(load_checkpoint(path), state(40))


def _rows_of(seed: int, rank: int) -> dict:
    """Rank `rank`'s row of a 2 x 3 tensor, as a piece of the whole."""
    from orangetron.parallel.state import Piece, Shards

    whole = torch.arange(6, dtype=torch.float64).view(2, 3) + seed
    return {"w": Shards((2, 3), torch.float64, (Piece((rank, 0), (1, 3), whole[rank:rank + 1].clone()),))}


def _save_then_crash_on_rank_1(folder: str) -> str:
    from orangetron import comm

    group = comm.world_group()
    save_checkpoint(folder, 2, _rows_of(2, group.rank), group)
    real_save = torch.save

    def dying_save(*args, **kwargs):
        if group.rank == 1:
            raise Crash("rank 1 dies while writing its shard")
        return real_save(*args, **kwargs)

    torch.save = dying_save
    try:
        save_checkpoint(folder, 4, _rows_of(4, group.rank), group)
    except Crash as err:
        return str(err)
    finally:
        torch.save = real_save
    return "no error"


def test_a_rank_dying_mid_save_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    from orangetron.testing import run_distributed

    errors = run_distributed(_save_then_crash_on_rank_1, 2, args=(str(tmp_path),))
    assert errors == ["rank 1 dies while writing its shard"] * 2  # rank 0 never renames the staging folder
    path = latest_checkpoint(tmp_path)
    assert path == checkpoint_dir(tmp_path, 2)
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(6, dtype=torch.float64).view(2, 3) + 2)
