"""How a command ends: on bad input, one line and exit 2; stopped (Ctrl-C, or a scheduler's
SIGTERM, raised as the same exception), one line and 130 or 143; its files left whole either way.

    from files import command

    @command.one_line(ConfigError, OSError)   # these end main with `error: <why>`, exit 2
    def main(argv=None) -> int:
        ...

Every CLI's main (train.py, eval.py, tools/*) says its errors this way, so a user meets the same
shape everywhere. An error type not listed keeps its traceback: a bug should be seen whole.
Standard library only.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`), raised where Ctrl-C raises KeyboardInterrupt, so both
    end a command the same clean way (its default kills the process: no message, no cleanup)."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside: SIGTERM raises Terminated in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                errno.EFBIG}


def is_write_error(e: BaseException) -> bool:
    """An OSError a full disk, a quota or a folder made read-only raises: one line for the user. Any
    other (a missing file from a bug, a reset connection) keeps its traceback."""
    return isinstance(e, OSError) and e.errno in WRITE_ERRNOS


def interrupted(e: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the command and its exit code: Ctrl-C 130, SIGTERM 143 (128 + the signal, as a
    shell reports)."""
    return ("SIGTERM", 143) if isinstance(e, Terminated) else ("Ctrl-C", 130)


def said_interrupted(e: KeyboardInterrupt,
                     what: str = "before it started; nothing was written") -> int:
    """One line for a command stopped while loading (models, data, hub files), and its exit code."""
    name, code = interrupted(e)
    print(f"\ninterrupted ({name}) {what}", file=sys.stderr)
    return code


def error(why: object, code: int = 2) -> int:
    """Say `error: <why>` on stderr -> `code` (2: bad input, fix and run again)."""
    print(f"error: {why}", file=sys.stderr)
    return code


def one_line(*errors: type[BaseException], stopped: str = "before it started; nothing was written"):
    """Decorate a command's main -> exit code: an exception of the types `errors` ends it with
    `error: <e>` and exit 2; a stop that main does not handle itself ends it with `stopped` (one
    line) and 130 or 143. SIGTERM is raised as a stop throughout main."""
    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                with sigterm_as_interrupt():
                    return main(*args, **kwargs)
            except errors as e:
                return error(e)
            except KeyboardInterrupt as e:
                return said_interrupted(e, stopped)
        return run
    return wrap
