"""The API client's reply cache (client.py): every reply paid for, kept so that no rerun pays twice.

    from api.reply_cache import ReplyCache, cache_key
    cache = ReplyCache("runs/x/judge_cache.jsonl", memory_size=10000, label="judge")
    key = cache_key("gpt-4o-mini", messages, temperature=0.0, max_tokens=512)
    cache.get(key)                                       # None: not cached
    cache.put(key, "Score: 7", {"prompt_tokens": 80, "completion_tokens": 3})

Two layers: a bounded in-memory LRU of recent replies, and an append-only JSONL file (one fsynced
line a reply, `{"key", "reply", "usage"}` plus `"finish": "length"` for a reply cut at max_tokens)
loaded at start. Only key -> byte offset is kept in RAM for the file, so a long run does not grow
RAM with reply text (GRubrics had to switch its in-memory cache off during RL for that reason). A
line torn by a kill is skipped; a file that holds lines but no cache records (a data file given by
mistake) is refused rather than appended to.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict

from files import jsonl

log = logging.getLogger(__name__)


def cache_key(model: str, messages: list[dict], temperature: float | None, max_tokens: int,
              extra_body: dict | None = None, sample: int = 0) -> str:
    """sha256 of the canonical JSON of everything that decides the reply (extra_body only when set,
    so caches written before it existed keep answering). sample > 0: the sample-th extra reply to
    the same request (K sampled answers to one prompt: K cached replies, not one reply K times)."""
    what = {"model": model, "messages": messages, "max_tokens": int(max_tokens),
            "temperature": None if temperature is None else float(temperature)}
    if extra_body:
        what["extra_body"] = extra_body
    if sample:
        what["sample"] = int(sample)
    blob = json.dumps(what, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    # a reply cut inside an emoji: a lone surrogate
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


class ReplyCache:
    """Replies by cache key: memory (LRU of memory_size; 0 = off), then the file at path (None =
    none); `key` is the config section that names the file (judge, precompute.answers,
    eval.api.NAME), for errors."""

    def __init__(self, path: str | None, memory_size: int, label: str, key: str = "judge"):
        self.path, self.memory_size, self.label, self.key = path, memory_size, label, key
        self.mem: OrderedDict[str, str] = OrderedDict()
        self.index: dict[str, int] = {}  # cache key -> byte offset of its line in path
        self.cut: set[str] = set()  # keys of replies cut at max_tokens ("length"), cached or not
        if path:
            try:
                self._load()
            except OSError as e:  # a folder, an unreadable file: a ValueError naming the section
                raise ValueError(f"{key}.cache_path={path}: {e.strerror or e}") from None

    def _load(self) -> None:
        bad, end = 0, 0
        for offset, end, rec in jsonl.read(self.path):  # noqa: B007 (end: the last line's, read below)
            if (rec is not None and isinstance(rec.get("key"), str)
                    and isinstance(rec.get("reply"), str)):
                self.index[rec["key"]] = offset
                if rec.get("finish") == "length":
                    self.cut.add(rec["key"])
            else:  # corrupt, or another kind of record
                bad += 1
        if bad and not self.index:  # not a cache: a data file (paid answers?) is never appended to
            raise ValueError(f"{self.key}.cache_path={self.path} holds lines but no cache records: "
                             "is it a data file? Give the cache a file of its own")
        if os.path.exists(self.path) and os.path.getsize(self.path) > end:
            bad += 1  # a last line torn by a kill
        if bad:
            log.warning("[minigrpo] warning: %s cache %s: skipped %d unreadable line(s); the rest "
                        "loaded", self.label, self.path, bad)

    def __contains__(self, key: str) -> bool:
        return key in self.index or key in self.mem

    def get(self, key: str) -> str | None:
        if key in self.mem:
            self.mem.move_to_end(key)
            return self.mem[key]
        offset = self.index.get(key)
        if offset is None:
            return None
        with open(self.path, "rb") as f:
            f.seek(offset)
            try:
                rec = json.loads(f.readline())
            except ValueError:
                rec = {}
        if rec.get("key") != key:  # another process appended meanwhile and the offset is stale
            return None
        self._remember(key, rec["reply"])
        return rec["reply"]

    def _remember(self, key: str, reply: str) -> None:
        if self.memory_size > 0:
            self.mem[key] = reply
            self.mem.move_to_end(key)
            while len(self.mem) > self.memory_size:
                self.mem.popitem(last=False)

    def put(self, key: str, reply: str, usage: dict[str, int]) -> None:
        """Keep a reply (fsynced: each line was paid for). OSError when the file cannot be written
        (a full disk): the reply is still in memory."""
        self._remember(key, reply)
        if self.path and key not in self.index:
            record = ({"key": key, "reply": reply, "usage": usage}
                      | ({"finish": "length"} if key in self.cut else {}))
            self.index[key] = jsonl.append(self.path, [record])
