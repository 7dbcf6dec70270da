"""One `orangetron train` per run folder at a time: the process that speaks for the run holds an exclusive
`flock` on `DIR/.lock`, which names its process id, until its descriptor closes, however the process ends.

Two processes once trained in one folder at once (a resume started beside the running run) and tore its
`metrics.jsonl`; a second `train` into a locked folder is now refused in one line. On CPU the ranks are forked
from the launcher and hold the lock with it; ranks started by a fork server (CUDA) do not, so a launcher killed
outright leaves its ranks' last checkpoint unguarded for the moment they take to save it and exit. A filesystem
that takes no locks (NFS without a lock daemon, some FUSE mounts) runs without one, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

from orangetron.train.config import TrainConfigError

LOCK_FILE = ".lock"
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # the filesystem cannot lock at all


def primary_process() -> bool:
    """Whether this process speaks for the run (writes its folder): rank 0 of an initialized process group,
    torchrun's RANK 0, or a process on its own."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0" or int(os.environ.get("WORLD_SIZE", "1")) <= 1


def take(folder: Path) -> int | None:
    """An open descriptor holding the lock of `folder` (made if missing), or None where its filesystem takes no
    locks (said on standard error). TrainConfigError naming --out where the folder cannot be written, or where
    another process holds it or took it between the lock file's opening and its locking."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise TrainConfigError(f"out={str(folder)!r} (--out): cannot write there ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno in _NO_LOCKS:
            print(f"orangetron train: warning: the filesystem of {folder} takes no locks ({err.strerror}): a second "
                  "`orangetron train` into it would not be refused", file=sys.stderr)
            return None
        raise _in_use(folder, f"process {holder}") from None
    if not _same_file(fd, folder / LOCK_FILE):  # moved aside, or removed, by the run that held it just now
        os.close(fd)
        raise _in_use(folder, "it took the folder just now")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(fd: int | None, folder: Path, made: bool, was_empty: bool = False) -> None:
    """Let the lock go. Where the folder holds nothing but the lock (a run refused once it had the folder), the
    lock file goes too if the folder was empty before (`was_empty`), and the folder with it if this run made it
    (`made`): neither is left as an output other commands refuse to write into."""
    if fd is None:
        return
    try:
        if (made or was_empty) and [path.name for path in folder.iterdir()] == [LOCK_FILE]:
            (folder / LOCK_FILE).unlink()
            if made:
                folder.rmdir()
    except OSError:
        pass  # another process wrote there meanwhile: the folder is not this run's to remove
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _in_use(folder: Path, who: str) -> TrainConfigError:
    return TrainConfigError(f"out={str(folder)!r} (--out): another `orangetron train` is running in this folder "
                            f"({who}); wait for it to end, or stop it first")
