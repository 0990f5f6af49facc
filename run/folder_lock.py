"""One writer per run folder. train.py (and eval.py, for eval.out_dir) holds an flock on
FOLDER/.lock for as long as it runs, taken before it reads or writes anything else there; a second
one on the same folder stops with exit code 2 and one line naming the first (the pid, host and
start time it wrote into the lock file). The kernel drops an flock when its process ends, by a
kill -9 too, so a lock file left behind blocks nothing: the next process takes it over.

    folder_lock.take(run_dir, "run.out_dir")   # ConfigError naming the holder if one runs
    @folder_lock.released_on_return           # on a CLI's main: its locks go when it returns

Released, the lock file is removed, and so is a folder that take() created and nothing else used
(bad input found after the lock, Ctrl-C while the model loads): such a run leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import os
import socket
import sys
import time
from pathlib import Path

from config import ConfigError
from parallel import distributed

NAME = ".lock"
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # FUSE, some NFS mounts


@dataclasses.dataclass
class Held:
    folder: Path
    fd: int  # -1: a file system without locks (NO_LOCKS), the folder still tracked
    made: Path | None  # the first folder on the way that take() created (removed again if empty)


HELD: list[Held] = []  # this process's locks, newest last


def take(folder: str | Path, key: str, dry_run: bool = False) -> None:
    """Hold `folder` for this process (created if missing) or raise ConfigError naming the process
    that holds it. A dry run (it writes nothing), torchrun's ranks > 0 (rank 0 writes the run) and
    a process that holds it already (a test's setup, then its main) take nothing."""
    folder = Path(folder)
    if dry_run or distributed.rank() > 0 or folder.resolve() in {h.folder.resolve() for h in HELD}:
        return
    made = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(folder / NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # a holder releasing it removed the folder meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 400).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(f"{key}={folder} is in use by {holder or 'another process'}; wait "
                              f"for it to end or stop it, or set another {key}") from None
        except OSError as e:
            if e.errno not in NO_LOCKS:
                raise
            os.close(fd)
            print(f"[minigrpo] warning: {folder} cannot be locked ({e.strerror}): make sure no "
                  "other process writes in it", file=sys.stderr)
            HELD.append(Held(folder, -1, made))
            return
        if same_file(fd, folder / NAME):
            break
        os.close(fd)  # its holder removed that file as we opened it: take the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{Path(sys.argv[0]).name} (pid {os.getpid()} on {socket.gethostname()}, "
                 f"running since {time.strftime('%Y-%m-%d %H:%M:%S %Z')})\n".encode())
    HELD.append(Held(folder, fd, made))


def same_file(fd: int, path: Path) -> bool:
    """Whether the open lock file is still the one at `path` (not removed, nor replaced)."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def release(keep: int = 0) -> None:
    """Let go of this process's locks past the first `keep`: each lock file removed (while still
    held, so that a process waiting on it takes a new one), then the folders take() created, if
    nothing else is in them."""
    while len(HELD) > keep:
        held = HELD.pop()
        with contextlib.suppress(OSError):
            (held.folder / NAME).unlink()
        if held.fd >= 0:
            os.close(held.fd)
        for folder in [held.folder, *held.folder.parents] if held.made else []:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one goes
            if folder == held.made:
                break


def released_on_return(main):
    """`main`, releasing the locks it took when it returns or raises (a process's end would drop
    them too, but a test calls main many times in one process, and the lock file should go)."""
    @functools.wraps(main)
    def with_release(*args, **kwargs):
        keep = len(HELD)
        try:
            return main(*args, **kwargs)
        finally:
            release(keep)
    return with_release
