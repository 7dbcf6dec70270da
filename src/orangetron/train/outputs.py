"""What a command writes never replaces what is already there unless asked: `export -o` and `train --out` refuse
an existing output, and with `--overwrite` move it aside to the first free `NAME.previous-N` instead of deleting
it (`tokenizer train` does the same for the tokenizer files in its folder: train/prepare.py; `plan --emit-config`
replaces only a file `plan` wrote and nobody edited since: cli/run_config.py). An output that is, or holds, one of
the command's own inputs is refused even with `--overwrite`: moving it aside would take the input along."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

Inputs = Sequence[tuple[str, str | Path | None]]  # what a command reads (what it is, where), None: nothing


def free_suffix(paths: Iterable[Path], start: int = 1) -> str:
    """The first `.previous-N`, N >= `start`, that names nothing (not even a dangling link) beside any of
    `paths`."""
    paths, n = list(paths), start
    while any(os.path.lexists(p.with_name(f"{p.name}.previous-{n}")) for p in paths):
        n += 1
    return f".previous-{n}"


def move_aside(path: Path, suffix: str | None = None) -> Path:
    """Rename `path` (a file or a folder) to `NAME` + `suffix` (default: the first free `.previous-N`) beside it;
    returns the new name. ValueError, in one line, for a path with no name of its own or a failed rename."""
    path = Path(os.path.abspath(path))  # "." and "name/.." get their real names; a link stays a link
    if path.name in ("", ".", ".."):
        raise ValueError(f"{str(path)!r}: has no name to move aside; choose another output")
    if Path.cwd().resolve().is_relative_to(path.resolve()):  # the process would follow it, writing into the old
        raise ValueError(f"{str(path)!r}: holds the working folder, which cannot move aside; run from outside it")
    n = 1
    while True:
        aside = path.with_name(path.name + (suffix or free_suffix([path], n)))
        try:
            _rename_keeping_what_is_there(path, aside)
            return aside
        except FileExistsError:  # taken since it was found free: another command moved its output there
            if suffix:
                raise ValueError(f"{str(path)!r}: could not move it aside: {aside.name} exists") from None
            n = int(aside.name.rsplit("-", 1)[1]) + 1
        except OSError as err:
            raise ValueError(f"{str(path)!r}: could not move it aside to {aside.name} ({err.strerror})") from None


def _rename_keeping_what_is_there(path: Path, aside: Path) -> None:
    """Rename `path` to `aside`, raising FileExistsError where `aside` exists: a plain rename replaces a file,
    so two commands that found the same name free would lose the first one's output. A folder replaces only an
    empty folder; a file (or a link) is linked under its new name first, which fails on any name taken."""
    if path.is_dir() and not path.is_symlink():
        try:
            path.rename(aside)
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise FileExistsError(err.errno, err.strerror, str(aside)) from None
            raise
        return
    try:
        os.link(path, aside, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: the rename, checked just before
        if os.path.lexists(aside):
            raise FileExistsError(errno.EEXIST, "exists", str(aside)) from None
        path.rename(aside)
        return
    path.unlink()


def check_holds_no_input(path: Path, flag: str, inputs: Inputs) -> None:
    """Refuse `path` as an output when it is, or holds, one of `inputs`: writing or moving it would replace or
    take away what the command reads."""
    target = Path(path).resolve()
    for what, source in inputs:
        if source is not None and Path(source).resolve().is_relative_to(target):
            raise ValueError(f"{flag} {str(path)!r}: holds {what} ({source}), which this command reads; choose "
                             "an output outside it")


def check_writable(path: Path, flag: str, inside: bool = False) -> None:
    """Refuse `path` as an output where the folder it would be written in (`path` itself when `inside`, its
    parent else) cannot take a file (a probe made and removed in its nearest existing folder): one line naming
    `flag` before the work, not a traceback after it."""
    check_outside_checkpoints(Path(path), flag)
    folder = Path(path).absolute() if inside else Path(path).absolute().parent
    while not os.path.lexists(folder):
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".orangetron-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{flag} {str(path)!r}: cannot write there ({err.strerror})") from None


def holds_checkpoints(folder: Path) -> bool:
    """Whether `folder` is a run's checkpoints folder: a `step-N` folder in it with its manifest."""
    return any(folder.glob("step-*/manifest.json"))


def check_outside_checkpoints(path: Path, flag: str) -> None:
    """Refuse `path` inside a run's checkpoints folder: a folder written there as `step-N` was taken for the
    newest checkpoint, and the run could be neither resumed nor sampled."""
    for folder in (path.resolve(), *path.resolve().parents):
        if folder.name == "checkpoints" and holds_checkpoints(folder):
            raise ValueError(f"{flag} {str(path)!r}: inside {folder}, a run's checkpoints folder, which holds its "
                             "checkpoints alone (a folder written there is taken for one); write elsewhere")


def check_claim(path: Path, flag: str, overwrite: bool, inputs: Inputs | None = None
                ) -> bool:
    """Refuse what `claim_output` would refuse, moving nothing (a command checks before its work, and claims
    after it); True when `path` holds something that would move aside."""
    check_holds_no_input(path, flag, inputs or ())
    check_writable(path, flag)
    if not os.path.lexists(path) or (path.is_dir() and not any(path.iterdir())):
        return False
    if not overwrite:
        raise ValueError(f"{flag} {str(path)!r}: exists; choose another name, or add --overwrite to move it aside "
                         f"to {path.name}.previous-N")
    return True


def claim_output(path: Path, flag: str, overwrite: bool,
                 inputs: Inputs | None = None) -> Path | None:
    """Make `path` free to write: nothing there (or an empty folder) is free; anything else is refused naming
    `flag`, or with `overwrite` moved aside. An output holding one of `inputs` is refused in any case. Returns
    where it went, if it moved."""
    return move_aside(path) if check_claim(path, flag, overwrite, inputs) else None
