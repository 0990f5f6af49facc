"""Files that survive a kill: append-only JSON Lines (the judge cache, people's ratings, a run's
logs) and atomic rewrites (results, configs).

    from files import jsonl
    # one write, fsynced; returns where the first record starts
    offset = jsonl.append(path, [{"key": "...", "reply": "..."}])
    for offset, end, record in jsonl.read(path):  # whole lines only; record None: not a JSON object
        ...
    jsonl.write_atomic(path, text)                # whole old file or whole new one, never half
    jsonl.write_records(path, records)            # the same, as JSON lines
    records = jsonl.records(path)                 # every whole record, in order
    rows = jsonl.load(path)   # a file one tool wrote for another: JSON Lines or one JSON list

A kill during a write leaves at most a torn last line. `append` first ends such a line, so new
records never glue onto it, and `read` never yields a line without its newline (it may still be
being written; a later read, from `end`, picks it up once whole). `load` is for files written whole
(eval.py's predictions, tools.bestofn's picks and pairs, the rating page's exports, your data):
strict, it never takes a file for one still being written. Appends hold an exclusive lock
(flock, where the OS has it) from the torn-line check to the fsync, so writers sharing a file (a
training run and an eval on one judge cache) neither interleave nor misreport offsets. Standard
library only: the ratings (graders/ratings.py, graders/rating_page.py) import this without torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: appends from one process at a time
    fcntl = None


def append(path: str | Path, records: list[dict]) -> int:
    """Append `records` as JSON lines in one write, fsynced (each line may have cost money or a
    person's time: it must outlive a crash right after). Returns the first record's byte offset."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:  # "a": every write goes to the end, whatever the position
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        size = f.seek(0, os.SEEK_END)
        torn = False
        if size:
            f.seek(size - 1)
            torn = f.read(1) != b"\n"
        # ASCII: a raw U+2028 or U+0085 in model output would split the line for readers that use
        # str.splitlines
        f.write((b"\n" if torn else b"") + lines(records).encode())
        f.flush()
        os.fsync(f.fileno())
    return size + torn


def read(path: str | Path, start: int = 0) -> Iterator[tuple[int, int, dict | None]]:
    """(offset, end, record) for each complete line of `path` from byte `start` (nothing when the
    file does not exist); record is None for a line that is not a JSON object (torn by a kill, or
    corrupt). One line in memory at a time, so a large cache file costs no RAM to scan."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for line in f:
            if not line.endswith(b"\n"):
                return  # the last line, not yet (or never) finished
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            end = offset + len(line)
            yield offset, end, record if isinstance(record, dict) else None
            offset = end


def records(path: str | Path) -> list[dict]:
    """Every complete JSON-object line of `path`, in order ([] when it does not exist); torn or
    corrupt lines are skipped, as `read` reports them."""
    return [record for _, _, record in read(path) if record is not None]


def parse(text: str, where: str = "") -> list:
    """The records of a text one tool wrote for another, whichever form it took: one JSON list (the
    rating page's /api/export and /export?format=json) or JSON Lines (eval.py's predictions,
    tools.bestofn's picks and pairs, tools.ratings export); blank lines are skipped. Strict, unlike
    `read`: a line that is not JSON, or a list that does not parse, is a ValueError naming `where`
    and the line, so a file is never skipped as one still being written.

    >>> parse('[{"a": 1}, {"a": 2}]') == parse('{"a": 1}\\n\\n{"a": 2}') == [{"a": 1}, {"a": 2}]
    True
    """
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}); "
                             "fix the file") from None
    rows = []
    for i, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit in a string
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}:{i}: not valid JSON ({e.msg}); "
                                 "fix or remove that line") from None
    return rows


def load(path: str | Path) -> list:
    """`parse` of the UTF-8 file at `path`."""
    return parse(Path(path).read_text(encoding="utf-8"), str(path))


def lines(records: list[dict], default=None) -> str:
    """`records` as JSON Lines text; `default`: json.dumps' hook for values JSON lacks (str)."""
    return "".join(json.dumps(r, default=default) + "\n" for r in records)


def write_records(path: str | Path, records: list[dict], default=None) -> None:
    """Replace `path` with `records` as JSON Lines, atomically (write_atomic)."""
    write_atomic(path, lines(records, default))


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Replace `path` with `text` (or bytes): written to path.tmp, fsynced, then renamed over it, so
    a kill or a power cut leaves the old file or the new one, never a half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") if isinstance(text, bytes) else open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, text that is not UTF-8: no half-written .tmp left behind
        tmp.unlink(missing_ok=True)
        raise
