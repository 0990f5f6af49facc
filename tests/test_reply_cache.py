"""reply_cache.py: the client's cache of paid replies, on its own (test_judge.py drives it through
the client)."""
import json
import logging

import pytest

from api.reply_cache import ReplyCache, cache_key

USAGE = {"prompt_tokens": 5, "completion_tokens": 2}


def test_a_reply_put_is_read_back_by_a_new_process_with_its_cut_flag(tmp_path):
    path = str(tmp_path / "c.jsonl")
    cache = ReplyCache(path, memory_size=10, label="judge")
    cache.cut.add("k2")  # the client marks a reply cut at max_tokens before putting it
    cache.put("k1", "Score: 7", USAGE)
    cache.put("k2", "Score: 3 because", USAGE)
    cache.put("k1", "Score: 7", USAGE)  # already on disk: not written twice
    lines = [json.loads(x) for x in open(path)]
    assert [r["key"] for r in lines] == ["k1", "k2"] and lines[1]["finish"] == "length" \
        and "finish" not in lines[0]
    again = ReplyCache(path, memory_size=0, label="judge")  # a restart, nothing in memory
    assert (again.get("k1"), again.get("k2"), again.get("k3")) == ("Score: 7", "Score: 3 because",
                                                                   None)
    assert again.cut == {"k2"} and "k1" in again and "k3" not in again


def test_a_line_torn_by_a_kill_is_skipped_and_the_rest_loaded(tmp_path, caplog):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"key": "a", "reply": "x", "usage": {}}) + "\n"
                    + '{"key": "b", "rep')
    with caplog.at_level(logging.WARNING):
        cache = ReplyCache(str(path), memory_size=10, label="judge")
    assert cache.get("a") == "x" and cache.get("b") is None
    assert any("skipped 1 unreadable line" in r.getMessage() for r in caplog.records)


def test_a_data_file_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"question": "q", "answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"^judge.cache_path=.* holds lines but no cache records"):
        ReplyCache(str(path), memory_size=10, label="judge")
    with pytest.raises(ValueError, match=r"^precompute.answers.cache_path=.* holds lines"):
        # the section that names it
        ReplyCache(str(path), memory_size=10, label="precompute.answers (m)",
                   key="precompute.answers")
    assert path.read_text() == json.dumps({"question": "q", "answers": ["a"]}) + "\n"


def test_memory_keeps_the_most_recently_used_replies_and_the_file_keeps_all(tmp_path):
    cache = ReplyCache(str(tmp_path / "c.jsonl"), memory_size=2, label="judge")
    for k in ("a", "b"):
        cache.put(k, k.upper(), USAGE)
    cache.get("a")  # "b" is now the least recent
    cache.put("c", "C", USAGE)
    assert list(cache.mem) == ["a", "c"]
    assert cache.get("b") == "B"  # from the file
    memory_only = ReplyCache(None, memory_size=1, label="judge")
    memory_only.put("a", "A", USAGE)
    memory_only.put("b", "B", USAGE)
    assert (memory_only.get("a"), memory_only.get("b")) == (None, "B")


def test_an_offset_made_stale_by_a_rewritten_file_reads_as_a_miss(tmp_path):
    path = tmp_path / "c.jsonl"
    cache = ReplyCache(str(path), memory_size=0, label="judge")
    cache.put("a", "A", USAGE)
    cache.put("b", "B", USAGE)
    # another tool rewrote it
    path.write_text(json.dumps({"key": "b", "reply": "B", "usage": {}}) + "\n")
    # b's offset now points past the end, never at another key's reply
    assert cache.get("b") is None


def test_cache_key_changes_with_whatever_changes_the_reply():
    msgs = [{"role": "user", "content": "q"}]
    base = cache_key("m", msgs, 0.0, 512)
    others = [cache_key("m2", msgs, 0.0, 512),
              cache_key("m", [{"role": "user", "content": "q2"}], 0.0, 512),
              cache_key("m", msgs, 1.0, 512), cache_key("m", msgs, None, 512),
              cache_key("m", msgs, 0.0, 256),
              cache_key("m", msgs, 0.0, 512, {"reasoning_effort": "low"}),
              cache_key("m", msgs, 0.0, 512, sample=1)]
    assert len({base, *others}) == 1 + len(others)
    # caches written before extra_body and samples still answer
    assert cache_key("m", msgs, 0.0, 512, {}, 0) == base
