"""Tests for jsonl.py: append-only JSON Lines that survive a kill."""
import json
import multiprocessing

import pytest

from files import jsonl


def test_append_returns_where_each_write_starts_and_read_gives_offsets_ends_and_records(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    assert list(jsonl.read(path)) == []  # no file yet: nothing, no error
    first = jsonl.append(path, [{"a": 1}, {"b": "é\u2028"}])  # the folder is created
    second = jsonl.append(path, [{"c": [1, 2]}])
    raw = path.read_bytes()
    assert first == 0 and second == raw.index(b'{"c"') and raw.endswith(b"\n") and raw.isascii()
    got = list(jsonl.read(path))
    assert [rec for _, _, rec in got] == [{"a": 1}, {"b": "é\u2028"}, {"c": [1, 2]}]
    # escaped: U+2028 would split a line for str.splitlines
    assert len(path.read_text().splitlines()) == 3
    assert [(o, e) for o, e, _ in got] == [(0, raw.index(b'{"b"')), (raw.index(b'{"b"'), second),
                                           (second, len(raw))]
    # from a saved end
    assert [rec for _, _, rec in jsonl.read(path, start=second)] == [{"c": [1, 2]}]


def test_a_line_torn_by_a_kill_is_not_read_and_the_next_append_starts_a_fresh_line(tmp_path):
    path = tmp_path / "log.jsonl"
    jsonl.append(path, [{"a": 1}])
    with open(path, "ab") as f:
        f.write(b'{"key": "half a rec')  # a kill mid-write: no newline
    # the unfinished line waits (or is torn)
    assert [rec for _, _, rec in jsonl.read(path)] == [{"a": 1}]
    offset = jsonl.append(path, [{"b": 2}])
    assert path.read_bytes()[offset:] == b'{"b": 2}\n'
    # the torn line: None, kept apart
    assert [rec for _, _, rec in jsonl.read(path)] == [{"a": 1}, None, {"b": 2}]


def test_lines_that_are_not_json_objects_read_as_none(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('[1, 2]\n"text"\nnot json\n{"ok": true}\n')
    assert [rec for _, _, rec in jsonl.read(path)] == [None, None, None, {"ok": True}]
    assert json.loads(path.read_text().splitlines()[-1]) == {"ok": True}


def _append_many(path: str, who: str, n: int, queue) -> None:
    queue.put((who, [(jsonl.append(path, [{"who": who, "i": i, "pad": "x" * 1500}]), i)
                     for i in range(n)]))


def test_two_processes_appending_to_one_file_keep_whole_lines_and_true_offsets(tmp_path):
    """A training run and an eval sharing a judge cache: the lock keeps each append whole and each
    returned offset pointing at the writer's own record."""
    path, n = tmp_path / "shared.jsonl", 200
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_append_many, args=(str(path), who, n, queue))
             for who in ("a", "b")]
    for p in procs:
        p.start()
    # read before join: a full pipe would block
    offsets = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    raw = path.read_bytes()
    records = [rec for _, _, rec in jsonl.read(path)]
    # no blank or torn line
    assert len(records) == 2 * n and None not in records and raw.count(b"\n") == 2 * n
    for who, got in offsets.items():
        for offset, i in got:
            rec = json.loads(raw[offset:raw.index(b"\n", offset)])
            assert (rec["who"], rec["i"]) == (who, i)


def test_write_atomic_that_fails_leaves_the_old_file_and_no_tmp(tmp_path):
    path = tmp_path / "out.jsonl"
    jsonl.write_atomic(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        jsonl.write_atomic(path, "new " + chr(0xD83D) + "\n")  # not encodable as UTF-8
    assert path.read_text() == "old\n" \
        and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
