"""Human ratings as a GRPO reward: a queue in a folder, a rating page, and the `human` reward.

The trainer queues each step's completions and waits; people rate them in a browser; the ratings
are the rewards (the question-generation workflow's "online mode"). Two terminals:

    python -m tools.ratings serve --dir runs/qgen_human/ratings    # then open http://127.0.0.1:8000
    python train.py --config configs/qgen_human.yaml  # rewards: [{name: human, args: {dir: ...}}]

    python -m tools.ratings stats --dir runs/qgen_human/ratings    # counts and mean scores (JSON)
    python -m tools.ratings export --dir runs/qgen_human/ratings > rated.jsonl  # scores and reward
    python -m tools.ratings export --dir runs/qgen_human/ratings --out rated.parquet  # or .jsonl
    python -m tools.bestofn rated.jsonl --pairs human_pairs.jsonl  # best- vs worst-rated: DPO pairs

The folder holds two append-only JSONL files, each line fsynced when written, so no rating is
lost to a kill (a line torn by one is skipped, and the next write starts a fresh line):

    queue.jsonl    trainer's: {"id", "batch", "prompt", "completion", "criteria", "scale", "time"}
                   (and "messages", a chat prompt as it was, when the prompt shown is its text)
    ratings.jsonl  page's:    {"id", "scores": {criterion: int}, "time"}

and `page_token`, the page's form token, kept so that a page open across a server restart saves,
and `serve.lock`, which a running `serve` holds so that a second server on the folder is refused.

An item's id hashes (prompt, completion, scale), so a completion that repeats (within a group, or
across steps and runs) is rated once and old ratings answer new runs. The page shows a prompt's
completions together (GRPO learns from how they compare), the newest batch first: the one the
trainer is waiting for. A form sent twice, or a second rater's form for answers rated meanwhile,
is not counted again (should the file hold two ratings of an answer, they are averaged).

    reward = mean over criteria of (score - lo) / (hi - lo)       in [0, 1], scale = [lo, hi]

The trainer waits until every completion of the batch is rated, saying every minute how many
are left; with `timeout_s` a completion waits at most that long after it was queued, then gets
the reward's fallback (counted in reward_errors/<name>) and stays on the page. The page has no
login: it listens on 127.0.0.1 unless --host says otherwise; reach it from elsewhere through an
SSH tunnel. The page, its form and its JSON API for rating tools of your own are in rating_page.py,
the seed's queue API in rating_queue.py, their server (Starlette under uvicorn: the `ratings`
extra, PAGE_EXTRA below; without it the reward stops before any model loads, saying what to
install) in rating_server.py; a script can also append to ratings.jsonl in the format above.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from files import jsonl
from rewards import register
from sources.maps import as_text

QUEUE, RATINGS = "queue.jsonl", "ratings.jsonl"
# the rating page's packages (pyproject.toml's `ratings` extra), at the versions the Makefile tests
PAGE_EXTRA = ("starlette==1.10.0", "uvicorn==0.54.0")


def page_missing() -> str | None:
    """What to install for the rating page, in one line, or None when it is installed."""
    gone = [p.split("==")[0] for p in PAGE_EXTRA
            if importlib.util.find_spec(p.split("==")[0]) is None]
    return (f"the rating page needs {' and '.join(gone)} (the `ratings` extra): "
            f"pip install {' '.join(PAGE_EXTRA)}") if gone else None


class BadRating(ValueError):
    """A rating line that parses but cannot count (a score not whole, or off its item's scale)."""


def say(msg: str) -> None:
    """A status line on stderr, as train.py writes its own."""
    print(f"[ratings {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def item_id(prompt: str, completion: str, scale: list[int]) -> str:
    """Content address of one item: the same prompt, completion and scale always get the same id (a
    5 on a 1-5 scale is not a 5 on 1-10, so a new scale asks again)."""
    return hashlib.sha256(json.dumps([prompt, completion, list(scale)]).encode()).hexdigest()[:24]


@dataclass
class Store:
    """What the folder holds, read incrementally: complete lines only, each file from where it was
    left."""
    dir: Path
    items: dict[str, dict] = field(default_factory=dict)  # id -> its latest queue record
    # id -> criterion -> every score given
    scores: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)  # file name -> bytes read
    files: dict[str, tuple] = field(default_factory=dict)  # file name -> (dev, inode, first bytes)
    # id -> monotonic time its wait ends (queued by this process)
    deadlines: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the page uses several threads

    def refresh(self) -> None:
        for name, take in ((QUEUE, self._take_item), (RATINGS, self._take_rating)):
            path = self.dir / name
            if not path.exists():
                continue
            st = path.stat()
            with open(path, "rb") as f:
                # appends never change it; a file copied over this one (same inode) does
                head = f.read(256)
            dev, ino, old_head = self.files.get(name, (st.st_dev, st.st_ino, b""))
            if (st.st_size < self.offsets.get(name, 0) or (dev, ino) != (st.st_dev, st.st_ino)
                    or not head.startswith(old_head)):
                self.offsets[name] = 0  # truncated, or replaced by another file: read it all again
                (self.items if name == QUEUE else self.scores).clear()
            self.files[name] = (st.st_dev, st.st_ino, head)
            # complete lines only: one still being written waits for the next refresh
            for _, end, rec in jsonl.read(path, self.offsets.get(name, 0)):
                self.offsets[name] = end
                try:
                    take(rec)
                except BadRating as e:
                    say(f"{path}: skipped a rating of {rec.get('id')!r}: {e}")
                except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
                    say(f"{path}: skipped an unreadable line (torn by a kill?)")

    def _take_item(self, rec: dict) -> None:
        item = {k: rec[k] for k in ("id", "batch", "prompt", "completion", "criteria", "scale")}
        if not (isinstance(item["id"], str) and type(item["batch"]) is int
                and isinstance(item["prompt"], str) and isinstance(item["completion"], str)
                and isinstance(item["criteria"], list) and item["criteria"]
                and all(isinstance(c, str) for c in item["criteria"])
                and isinstance(item["scale"], list) and len(item["scale"]) == 2
                and all(type(v) is int for v in item["scale"])
                and item["scale"][0] < item["scale"][1]
                and isinstance(rec.get("messages", []), list)):
            # one bad line must not stop the page, the stats or training
            raise ValueError("not a queue record")
        if "messages" in rec:
            item["messages"] = rec["messages"]
        if isinstance(rec.get("role_id"), str):  # sent to the seed's /api/queue/submit
            item["role_id"] = rec["role_id"]
        self.items[rec["id"]] = item

    def _take_rating(self, rec: dict) -> None:
        # a bad record raises before anything is kept
        scores = {str(c): v for c, v in rec["scores"].items()}
        if not all(type(v) is int for v in scores.values()):
            raise BadRating(f"scores must be whole numbers, got {scores}")
        if (item := self.items.get(rec["id"])) and not all(
                item["scale"][0] <= v <= item["scale"][1] for v in scores.values()):
            raise BadRating(f"scores {scores} fall outside the item's scale {item['scale']}")
        given = self.scores.setdefault(rec["id"], {})
        for criterion, value in scores.items():
            given.setdefault(criterion, []).append(value)

    def rated(self, id_: str, criteria: list[str]) -> dict[str, float] | None:
        """Mean score per criterion, or None while any criterion is unrated; a score outside the
        item's scale (written before its item was read) does not count."""
        lo, hi = self.items[id_]["scale"] if id_ in self.items else (-math.inf, math.inf)
        given = {c: [v for v in self.scores.get(id_, {}).get(c, []) if lo <= v <= hi]
                 for c in criteria}
        if not all(given.values()):
            return None
        return {c: sum(given[c]) / len(given[c]) for c in criteria}

    def pending(self, newest_first: bool = True) -> list[dict]:
        """Queued items not yet rated on their criteria: newest batch first, then queue order (or
        queue order alone: oldest first)."""
        waiting = [it for it in self.items.values() if self.rated(it["id"], it["criteria"]) is None]
        # stable: queue order within a batch
        return sorted(waiting, key=lambda it: -it["batch"]) if newest_first else waiting

    def next_group(self) -> list[dict]:
        """The pending completions of one prompt in the newest batch: rated side by side, since GRPO
        learns only from how a group's completions compare."""
        pending = self.pending()
        return [it for it in pending
                if (it["batch"], it["prompt"]) == (pending[0]["batch"], pending[0]["prompt"])]

    def rate(self, form: dict[str, str]) -> str | int:
        """Record the page's form (`ids`, and `<id>.<criterion>` per item) in one write: all of it
        (-> the number of items rated), or nothing (-> the reason it is refused). Items rated
        meanwhile (a resent form, a second rater) are skipped, so no rating is counted twice."""
        ids = list(dict.fromkeys(filter(None, form.get("ids", "").split(","))))
        if not ids:
            return "nothing to save: the form named no items"
        records = []
        for id_ in ids:
            item = self.items.get(id_)
            if item is None:
                return f"unknown item {id_!r}"
            if self.rated(id_, item["criteria"]) is not None:
                continue
            (lo, hi), scores = item["scale"], {}
            for c in item["criteria"]:
                value = form.get(f"{id_}.{c}", "")
                try:
                    scores[c] = int(value)
                except ValueError:
                    scores[c] = None
                if (scores[c] is None or not lo <= scores[c] <= hi
                        or value.strip() != str(scores[c])):
                    return (f"{c}: give every answer a whole number from {lo} to {hi} "
                            f"(got {value!r})")
            records.append({"id": id_, "scores": scores, "time": time.time()})
        if records:
            jsonl.append(self.dir / RATINGS, records)
            self.refresh()  # read back from the file, like every other rating: counted once
        return len(records)

    def rated_items(self) -> list[dict]:
        """Every queued item with a rating on its criteria: its prompt (a chat prompt's messages as
        they were), criteria, scale, mean scores, and reward, the human reward's value over all its
        criteria: mean of (score - lo) / (hi - lo)."""
        out = []
        for it in self.items.values():
            scores = self.rated(it["id"], it["criteria"])
            if scores is not None:
                out.append({"id": it["id"], "prompt": it.get("messages", it["prompt"]),
                            "completion": it["completion"], "criteria": it["criteria"],
                            "scale": it["scale"], "scores": scores,
                            "reward": rescaled(scores, it["criteria"], it["scale"])})
        return out

    def stats(self) -> dict:
        rated = self.rated_items()
        criteria = sorted({c for it in rated for c in it["scores"]})
        return {"queued": len(self.items), "rated": len(rated), "pending": len(self.pending()),
                "mean_scores": {c: round(sum(s) / len(s), 3) for c in criteria
                                if (s := [it["scores"][c] for it in rated if c in it["scores"]])}}


def parquet_bytes(rows: list[dict]) -> bytes:
    """The rated items as one Parquet file (pyarrow, which datasets installs): a column per field,
    `scores` a struct of every criterion (null where an item had not that one). ValueError when a
    column mixes kinds, such as text prompts and chat prompts in one folder."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ValueError(f"the rated items do not fit one Parquet table ({e}); "
                         "export them as JSON Lines") from None
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def export(rows: list[dict], out: str) -> None:
    """`ratings.py export --out FILE`: .jsonl or .parquet, written atomically, never over a file."""
    path = Path(out)
    parquet = path.suffix.lower() in (".parquet", ".pq")
    if not parquet and path.suffix.lower() != ".jsonl":
        raise ValueError(f"--out {out}: give a .jsonl or a .parquet file")
    if path.exists():
        raise ValueError(f"--out {out} exists and is never overwritten; give a new file")
    jsonl.write_atomic(path, parquet_bytes(rows) if parquet else jsonl.lines(rows))


def rescaled(scores: dict[str, float], criteria: list[str], scale: list[int]) -> float:
    """The human reward: mean over `criteria` of (score - lo) / (hi - lo), scale = [lo, hi]."""
    lo, hi = scale
    return sum((scores[c] - lo) / (hi - lo) for c in criteria) / len(criteria)


_STORES: dict[Path, Store] = {}  # one per folder per process, so each step reads only what is new


def store_for(dir: str | Path) -> Store:
    path = Path(dir).expanduser().resolve()
    if path not in _STORES:
        _STORES[path] = Store(path)
    return _STORES[path]


# --- the reward ---------------------------------------------------------------------------------
def check_args(dir: str | None = None, criteria: list[str] = ("overall",),
               scale: list[int] = (1, 5), criterion: str | None = None, timeout_s: float = 0.0,
               poll_s: float = 1.0, **_) -> None:
    """The human reward's args, checked before any model loads (checks.check_specs); ValueError
    says what to fix."""
    if not isinstance(dir, str) or not dir:
        raise ValueError("reward 'human' needs args.dir: the ratings folder that "
                         "`python -m tools.ratings serve --dir` serves")
    if problem := scale_problem(criteria, scale):
        raise ValueError(f"reward 'human': {problem}")
    if criterion is not None and criterion not in criteria:
        raise ValueError(f"reward 'human': criterion {criterion!r} must be one of the criteria "
                         f"{list(criteria)}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s >= 0
            and isinstance(poll_s, (int, float)) and poll_s > 0):
        raise ValueError("reward 'human': need timeout_s >= 0 (0: no limit) and poll_s > 0; "
                         f"got {timeout_s!r}, {poll_s!r}")
    if missing := page_missing():  # without the page, nobody could rate: the run would wait forever
        raise ValueError(f"reward 'human': {missing}")


def scale_problem(criteria, scale) -> str | None:
    """What is wrong with an item's criteria (a list of names) and scale ([lo, hi], whole numbers,
    lo < hi), or None: the human reward's args and the seed's /api/queue/submit share it.

    >>> scale_problem(["clarity"], [1, 5]), scale_problem(["clarity"], [5, 1])[:5]
    (None, 'scale')
    """
    if (isinstance(criteria, str) or not isinstance(criteria, (list, tuple)) or not criteria
            or not all(isinstance(c, str) and c for c in criteria)):
        return f"criteria must be a list of names, e.g. [relevance, clarity]; got {criteria!r}"
    if (not isinstance(scale, (list, tuple)) or len(scale) != 2
            or not all(type(v) is int for v in scale) or scale[0] >= scale[1]):
        return f"scale must be two whole numbers [lo, hi] with lo < hi; got {scale!r}"
    return None


def human(completions: list[str], samples: list[dict], *, dir: str,
          criteria: list[str] = ("overall",), scale: list[int] = (1, 5),
          criterion: str | None = None, timeout_s: float = 0.0, poll_s: float = 1.0,
          prompt_key: str = "prompt", forced_prefix: str | None = None) -> list[float]:
    """People's rating of each completion, (score - lo) / (hi - lo) averaged over the criteria.

    Queues the completions not yet rated nor already queued by this process, and waits until each
    is rated or, with timeout_s > 0, until timeout_s after it was queued; NaN where no rating came
    (the fallback, counted as an error). `criterion` returns that one criterion instead: list the
    reward again with weight 0 and a label to log each one; those calls queue nothing new and wait
    no longer than the first. A rater sees forced_prefix (data.assistant_prefix, passed in by the
    trainer) + the completion, as the queue and its export keep it.
    """
    check_args(dir, criteria, scale, criterion, timeout_s, poll_s)
    criteria, (lo, hi) = list(criteria), scale
    store = store_for(dir)
    shown = [(as_text(s[prompt_key]), (forced_prefix or "") + c)
             for c, s in zip(completions, samples, strict=True)]
    messages = {p: s[prompt_key] for (p, _), s in zip(shown, samples)
                if isinstance(s[prompt_key], list)}  # chat prompts
    ids = [item_id(p, c, scale) for p, c in shown]
    with store.lock:
        store.refresh()
        now, batch, new = time.monotonic(), time.time_ns(), []
        for id_, (prompt, completion) in dict(zip(ids, shown)).items():  # each distinct item once
            if store.rated(id_, criteria) is None and id_ not in store.deadlines:
                store.deadlines[id_] = now + timeout_s if timeout_s > 0 else math.inf
                new.append({"id": id_, "batch": batch, "prompt": prompt, "completion": completion,
                            "criteria": criteria, "scale": [lo, hi], "time": time.time(),
                            **({"messages": messages[prompt]} if prompt in messages else {})})
        if new:
            jsonl.append(store.dir / QUEUE, new)
    start, last_said = time.monotonic(), -math.inf
    while True:
        with store.lock:
            store.refresh()
            got = [store.rated(i, criteria) for i in ids]
        now = time.monotonic()
        waiting = {i for i, g in zip(ids, got) if g is None and store.deadlines.get(i, 0) > now}
        if not waiting:
            break
        if now - last_said >= 60:
            last_said = now
            say(f"waiting for people's ratings: {len(waiting)} of {len(set(ids))} left "
                f"({now - start:.0f} s so far); rate them on the page of "
                f"`python -m tools.ratings serve --dir {dir}`")
        time.sleep(poll_s)
    unrated = {i for i, g in zip(ids, got) if g is None}
    if unrated:
        say(f"{len(unrated)} item(s) unrated after timeout_s={timeout_s:g} s get the fallback; "
            "they stay on the page")

    def value(g: dict[str, float] | None) -> float:
        if g is None:
            return math.nan
        return rescaled(g, [criterion] if criterion else criteria, scale)
    return [value(g) for g in got]


human.check_args = check_args  # checks.check_specs calls a reward's check_args(**args), if any
register("human", batched=True, row_keys=("prompt_key",))(human)
