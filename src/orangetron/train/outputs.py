"""What a command writes never replaces what is already there unless asked: `export -o` and `train --out` refuse
an existing output, and with `--overwrite` move it aside to the first free `NAME.previous-N` instead of deleting
it (`tokenizer train` does the same for the tokenizer files in its folder: train/prepare.py; `plan --emit-config`
replaces only a file `plan` wrote: cli/run_config.py)."""

from __future__ import annotations

from pathlib import Path


def move_aside(path: Path) -> Path:
    """Rename `path` (a file or a folder) to the first free `NAME.previous-N` beside it; returns the new name."""
    n = 1
    while (aside := path.with_name(f"{path.name}.previous-{n}")).exists():
        n += 1
    path.rename(aside)
    return aside


def claim_output(path: Path, flag: str, overwrite: bool) -> Path | None:
    """Make `path` free to write: nothing there (or an empty folder) is free; anything else is refused naming
    `flag`, or with `overwrite` moved aside. Returns where it went, if it moved."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if not overwrite:
        raise ValueError(f"{flag} {str(path)!r}: exists; choose another name, or add --overwrite to move it aside "
                         f"to {path.name}.previous-N")
    return move_aside(path)
