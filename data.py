"""Training prompts: a built-in task, local files, hub datasets or a weighted mix of them, turned
into rows (dicts) holding a "prompt" plus every column the rewards read, drawn reproducibly.

    sources = load_sources(cfg.data)           # list[Source]: label, rows, weights
    rows = load_rows(cfg.data)                 # all sources' rows, each with row["prompt"]
    # the draw order: PromptSampler([len(s.rows) for s in sources], seed, weights)

`data.prompt` is a column name or a template over the columns ("Q: {question}\\nA) {opa}"; write
literal braces as {{ }}). `data.map` rewrites each row first (a built-in map of sources/maps.py,
e.g. medmcqa_json adds the JSON reply to learn, or your own file.py:function). A row missing a
needed field is an error naming the row and the field.

Splits: `data.split_seed` shuffles all rows exactly as `datasets.Dataset.shuffle(seed=...)` does
(numpy's default_rng permutation), then `data.select: [start, end)` keeps a range, so
`split_seed: 42, select: [1000, 1500]` is `ds.shuffle(seed=42).select(range(1000, 1500))`.

Mixtures (`data.mixture`, or a named one from `data.presets` chosen by `data.preset`): each source
is loaded, split and mapped like a single dataset (with its own `select`, `map` and `prompt`
where it sets them, else data.*); each drawn prompt comes from source s with
probability w_s(t) / sum_k w_k(t), where t = (step - 1) / (steps - 1) runs from 0 to 1 and
w_s(t) = weight + (weight_end - weight) * t, so `weight_end` turns a mix into a curriculum. Data
files are only ever read.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import random
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from config import DATA_SUFFIXES, ConfigError, DataConfig, active_mixture
from files import jsonl
from sources.hub import hub_unreachable, offline_if_unreachable
from sources.maps import MAPS
from sources.plugins import import_function


class DataError(ConfigError):
    """A dataset problem the user must fix (missing file, row without a needed field)."""


class MissingField(DataError):
    """A row without (or with an empty) field it needs: data.skip_incomplete leaves it out."""


def arithmetic_task(num_examples: int = 0, seed: int = 1234, max_operand: int = 20) -> list[dict]:
    """The quickstart task, built in code: distinct additions a + b (1 <= a, b <= max_operand; 400
    of them, all when num_examples is 0) in a seeded order, the sum as the gold answer. Distinct, so
    any two row ranges are disjoint as problems; a + b and b + a are two problems (of the
    quickstart's 100 held out, 73 have their swap in training).

    >>> arithmetic_task(2, seed=0)[0]["prompt"]
    'What is 8 + 11? Reply with just the number.'
    """
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    if num_examples > len(pairs):
        raise DataError(f"the arithmetic task has {len(pairs)} distinct problems; "
                        f"data.num_examples={num_examples} is too many")
    random.Random(seed).shuffle(pairs)
    return [{"prompt": f"What is {a} + {b}? Reply with just the number.", "answer": str(a + b)}
            for a, b in pairs[:num_examples or len(pairs)]]


BUILTIN_TASKS = {"arithmetic": arithmetic_task}


def _read_file(path: Path, key: str = "data.name") -> list[dict]:
    """A local file's rows; a file that cannot be read as its suffix says is one DataError line."""
    suffix = path.suffix.lower()
    try:
        return _parse_file(path, suffix, key)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except DataError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid for a non-Parquet file, csv's Error, ...
        raise DataError(f"{path}: cannot read it as {suffix[1:]} ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]})") from None


def _parse_file(path: Path, suffix: str, key: str) -> list[dict]:
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        # one object holding the rows: {"data": [...]}
        if suffix == ".json" and text.lstrip().startswith("{"):
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None  # JSON lines in a .json file
            if isinstance(whole, dict):  # a list of chat messages is a row's column, not the rows
                lists = [k for k, v in whole.items()
                         if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
                         and not all({"role", "content"} <= set(x) for x in v)]
                if len(lists) > 1:
                    raise DataError(f"{path} holds one JSON object with several lists of rows "
                                    f"({', '.join(lists)}); write the one to train on as a list "
                                    "of rows, or one row per line")
                if lists:
                    return whole[lists[0]]
        try:  # a JSON list or JSON Lines, as every tool reads the others' files
            return jsonl.parse(text, str(path))
        except ValueError as e:
            raise DataError(str(e)) from None
    if suffix == ".csv":
        # -sig: Excel's byte-order mark is not part of a name
        with path.open(newline="", encoding="utf-8-sig") as f:
            return list(csv.DictReader(f))
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    raise DataError(f"{key}={path}: unsupported file type '{suffix}'; "
                    "use .jsonl, .json, .csv or .parquet")


def local_path(cfg: DataConfig, name: str) -> Path:
    """Where a data file name points: relative names are read from data.root when it is set."""
    path = Path(name).expanduser()
    return Path(cfg.root).expanduser() / path if cfg.root and not path.is_absolute() else path


def load_raw(cfg: DataConfig, key: str = "data.name"):
    """Rows as they are stored, before prompts are built: a list of dicts, or a hub Dataset. key:
    the setting that named cfg.name (eval.name, precompute.questions), for the errors."""
    if cfg.name is None:
        raise DataError(f"{key} is null: give a local data file, a hub dataset id, a built-in task "
                        "or a data.mixture")
    if cfg.name in BUILTIN_TASKS:
        return BUILTIN_TASKS[cfg.name](cfg.num_examples)
    path = local_path(cfg, cfg.name)
    if path.is_file():
        rows = _read_file(path, key)
    elif not path.is_dir() and (cfg.name.startswith((".", "/", "~"))
                                or path.suffix.lower() in DATA_SUFFIXES):
        raise DataError(f"{key}={cfg.name}: no such file{f' ({path})' if cfg.root else ''}; give a "
                        "local data file, a hub dataset id or a built-in task "
                        f"({', '.join(BUILTIN_TASKS)})")
    else:  # a hub id, or a dataset folder (downloaded with `hf download --repo-type dataset`)
        import datasets
        where = str(path) if path.is_dir() else cfg.name
        try:  # a Dataset, not a list: split() then converts only the rows it keeps (MedMCQA: 183k)
            with offline_if_unreachable():
                rows = datasets.load_dataset(where, cfg.config_name, split=cfg.split,
                                             revision=cfg.revision)
        # the hub raises many types; the user needs the first lines ("pick one among: ...")
        except Exception as e:
            why = " ".join(line.strip() for line in str(e).splitlines()[:2]) or type(e).__name__
            config = f"config {cfg.config_name}, " if cfg.config_name else ""
            # datasets' "Couldn't reach": not cached
            missing = isinstance(e, ConnectionError) and not path.is_dir()
            raise DataError(
                f"could not load hub dataset {key}={cfg.name} ({config}split {cfg.split}): "
                f"{(hub_unreachable(cfg.name, 'dataset') if missing else '') or why}") from None
        if cfg.num_examples:
            rows = rows.select(range(min(cfg.num_examples, len(rows))))
        return rows
    if cfg.num_examples:
        rows = rows[: cfg.num_examples]
    return rows


class _Listed(list):
    """A list column in a template reads "Go, Postgres", not "['Go', 'Postgres']"; {col[0]} still
    indexes."""
    def __format__(self, spec: str) -> str:
        return format(", ".join(map(str, self)), spec)


def build_prompt(row: dict, template: str, index: int) -> str:
    """A column's value, or the template filled from the row's columns."""
    if "{" not in template:
        if row.get(template) in (None, ""):
            raise MissingField(f"row {index} has no (or an empty) field '{template}'; "
                            f"its fields: {', '.join(row)}")
        return row[template]
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    except ValueError:  # malformed: format_map below says so
        fields = []
    if any("." in field.split("[")[0] for field in fields):
        raise DataError(f"the template {template!r} reads an attribute ({{column.name}}); "
                        "name columns only, as {column} (or {column[0]} for a list's first item)")
    empty = [f for f in row if row[f] in (None, "") and "{" + f + "}" in template]
    if empty:  # a null would be rendered as the text "None"
        raise MissingField(f"row {index} has an empty field '{empty[0]}' used in the template "
                        f"{template!r}")
    try:
        return template.format_map({k: _Listed(v) if isinstance(v, list) else v
                                    for k, v in row.items()})
    except KeyError as e:
        raise MissingField(f"row {index} has no field {e} used in the data.prompt template; "
                        f"its fields: {', '.join(row)}") from None
    except (ValueError, IndexError, AttributeError) as e:
        raise DataError(f"data.prompt template {template!r} is malformed ({e}); use {{column}} "
                        "and write literal braces as {{ }}") from None


def group_rows(rows, by: str, lists: dict[str, str], name: str) -> list[dict]:
    """Rows sharing the value of the column `by` as one row, in the order the values first appear:
    each list column of `lists` collects its row column over the group (file order), the other
    columns are the group's first row's (data.group_by, data.group_lists).

    >>> rows = [{"q": "a", "answer": "x", "gold": 1}, {"q": "b", "answer": "z", "gold": 0},
    ...         {"q": "a", "answer": "y", "gold": 0}]
    >>> group_rows(rows, "q", {"answers": "answer", "gold_scores": "gold"}, "f")[0]
    {'q': 'a', 'answer': 'x', 'gold': 1, 'answers': ['x', 'y'], 'gold_scores': [1, 0]}
    """
    if not lists:
        raise DataError(f"data.group_by={by}: give data.group_lists, the list columns a group "
                        "collects (e.g. {answers: answer, gold_scores: gold_score})")
    groups: dict[str, dict] = {}
    for i in range(len(rows)):  # a hub Dataset too
        row = rows[i]
        missing = [c for c in (by, *lists.values()) if c not in row]
        if missing:
            raise DataError(f"data.group_by: row {i} of {name} has no field '{missing[0]}'; its "
                            f"fields: {', '.join(row)}")
        key = json.dumps(row[by], sort_keys=True, default=str)
        group = groups.setdefault(key, {**row, **{new: [] for new in lists}})
        for new, column in lists.items():
            group[new].append(row[column])
    return list(groups.values())


def split(rows, seed: int | None, select: list[int] | None) -> list:
    """Shuffle with `seed` as `datasets.Dataset.shuffle(seed=seed)` does (None: keep the order),
    then keep rows [start, end). Disjoint ranges of the same seed give disjoint splits, reproducibly
    (MedMCQA: 0-1000 SFT, 1000-1500 GRPO, 1500-1700 eval).

    >>> (split(list(range(10)), 42, [0, 3]) == split(list(range(10)), 42, [0, 3]),
    ...  split(list(range(5)), None, [1, 3]))
    (True, [1, 2])
    """
    order = (np.random.default_rng(seed).permutation(len(rows)).tolist() if seed is not None
             else range(len(rows)))
    if select is not None:
        if not len(rows):
            raise DataError("the data holds no rows")
        if select[1] > len(rows):
            raise DataError(f"select {select} reaches past the {len(rows)} rows of the dataset")
        order = order[select[0]:select[1]]
    return [rows[i] for i in order]


# ------------------------------------------------------------------ row maps (sources/maps.py)


def resolve_map(name: str) -> Callable[[dict], dict]:
    if name in MAPS:
        return MAPS[name]
    if ":" not in name:
        raise DataError(f"data.map={name!r} is not a built-in map ({', '.join(MAPS)}) nor "
                        "'file.py:function' / 'module:function'")
    try:
        return import_function(name, what="data.map")
    except ValueError as e:
        raise DataError(str(e)) from None


# ----------------------------------------------------------------------------- sources


@dataclass
class Source:
    label: str  # the name in metrics: data/<label>
    rows: list[dict]  # checked rows, each with "prompt"
    weight: float  # relative draw weight at the first step
    weight_end: float  # ... and at the last step
    positions: list[int]  # each row's place among the selected rows before data.map (a
    #   filtering map leaves gaps), for eval's predictions: one per row


def _label(name: str) -> str:
    path = Path(name)
    return path.stem if path.suffix.lower() in DATA_SUFFIXES else name.rstrip("/").split("/")[-1]


def load_sources(cfg: DataConfig, select: list[int] | None = None, hub_split: str | None = None,
                 key: str = "data.name") -> list[Source]:
    """Every source loaded, split, mapped and checked up front, so a bad row stops the run before
    anything is written. eval.py's held-out rows: `select` replaces data.select and each source's
    own select, `hub_split` data.split and each source's split (eval.select, eval.split)."""
    mix_key, mix = active_mixture(cfg)
    if mix is None:
        rows, pos = _prepare(dataclasses.replace(cfg, split=hub_split or cfg.split), select, key)
        return [Source(_label(cfg.name), rows, 1.0, 1.0, pos)]
    out, seen = [], {}
    for n, src in enumerate(mix):
        sub = dataclasses.replace(cfg, name=src.name, config_name=src.config_name,
                                  revision=src.revision, split=hub_split or src.split,
                                  prompt=src.prompt or cfg.prompt, map=src.map or cfg.map,
                                  select=src.select or cfg.select, num_examples=src.num_examples)
        label = src.label or _label(src.name)
        seen[label] = seen.get(label, 0) + 1
        label = label if seen[label] == 1 else f"{label}#{seen[label]}"
        try:
            rows, pos = _prepare(sub, select, f"{mix_key}[{n}].name",
                                 f"{mix_key}[{n}].map" if src.map else "data.map")
        except DataError as e:
            raise DataError(f"data source {label!r}: {e}") from None
        out.append(Source(label, rows, src.weight,
                          src.weight if src.weight_end is None else src.weight_end, pos))
    return out


def check_not_data_file(cfg: DataConfig, path: str | None, key: str) -> None:
    """A file the run writes (the judge's cache) must not be one of the data files, which are only
    read (GRubrics' pre-computed answers cost money: never touch them). Every source the config
    names counts, in any preset, not only the ones this run reads."""
    if not path:
        return
    target = Path(path).expanduser().resolve()
    sources = [s for mix in [cfg.mixture or [], *cfg.presets.values()] for s in mix or []]
    if any(local_path(cfg, n).resolve() == target
           for n in [s.name for s in sources] + [cfg.name] if n):
        raise DataError(f"{key}={path} is a data file; the run appends to it, "
                        "so give it a file of its own")


def load_rows(cfg: DataConfig, select: list[int] | None = None) -> list[dict]:
    """The rows of every source, in source order (see load_sources)."""
    return [row for s in load_sources(cfg, select) for row in s.rows]


def mapped_rows(rows, name: str, map_name: str | None,
                key: str = "data.map") -> list[tuple[int, dict]]:
    """Each row (of the data `name`) as a dict rewritten by the row map `map_name` (built-in or
    file.py:fn, the config key `key`), with its position in `rows` -> [(i, row)]; a map that returns
    None leaves the row out (a filter: rows too long, or without gold), and says how many it left
    out. DataError names the row that failed. Splits (split_seed, select) are taken before the map,
    so a filter never moves a row across them."""
    if not rows:
        raise DataError(f"{name} holds no rows")
    fn = resolve_map(map_name) if map_name else None
    out = []
    for i in range(len(rows)):  # a hub Dataset too
        row = rows[i]
        if not isinstance(row, dict):
            raise DataError(f"row {i} of {name} is not an object with fields")
        if fn is not None:
            try:
                row = fn(dict(row))
            except Exception as e:
                raise DataError(f"{key}={map_name} failed on row {i}: "
                                f"{type(e).__name__}: {e}") from None
            if row is None:
                continue
            if not isinstance(row, dict):
                raise DataError(f"{key}={map_name} returned {type(row).__name__} for row {i}; "
                                "it must return a dict (or None)")
        out.append((i, row))
    if not out:
        raise DataError(f"{key}={map_name} left out every one of the {len(rows)} rows of {name}")
    if len(out) < len(rows):
        print(f"[minigrpo] {key}={map_name} left out {len(rows) - len(out)} of the {len(rows)} "
              f"rows of {name}", file=sys.stderr)
    return out


def _prepare(cfg: DataConfig, select: list[int] | None, key: str = "data.name",
             map_key: str = "data.map") -> tuple[list[dict], list[int]]:
    """The checked rows of one source (named by the config keys `key` and `map_key`), with each
    one's place before the map -> (rows, places)."""
    rows = load_raw(cfg, key)
    if cfg.group_by:  # one answer a row -> one question a row, before the splits pick questions
        rows = group_rows(rows, cfg.group_by, cfg.group_lists, f"{key}={cfg.name}")
    rows = split(rows, cfg.split_seed, select if select is not None else cfg.select)
    out, places, missing = [], [], []
    # i: the row's place before a filtering map
    for i, row in mapped_rows(rows, f"{key}={cfg.name}", cfg.map, map_key):
        try:
            out.append(_prepared_row(cfg, row, i))
            places.append(i)
        except MissingField as e:
            if not cfg.skip_incomplete:
                raise DataError(f"{e} (data.skip_incomplete: true leaves such rows out)") from None
            missing.append(str(e))
    if missing:
        if not out:
            raise DataError(f"data.skip_incomplete: every row of {cfg.name} lacks a field it needs "
                            f"(the first: {missing[0]})")
        print(f"[minigrpo] data.skip_incomplete: left out {len(missing)} of the "
              f"{len(missing) + len(out)} rows of {cfg.name} (the first: {missing[0]})",
              file=sys.stderr)
    return out, places


def _prepared_row(cfg: DataConfig, row: dict, i: int) -> dict:
    """One row with its "prompt" (and replies) built and checked; MissingField if it lacks one."""
    prompt, replies = _split_replies(cfg, row, i, build_prompt(row, cfg.prompt, i))
    no_gold = bool(cfg.answer_key) and row.get(cfg.answer_key) in (None, "")
    conversation = _is_conversation(prompt)
    if not (isinstance(prompt, str) or conversation) or not prompt:
        raise DataError(f"row {i}: the prompt is "
                        f"{type(prompt).__name__ if prompt else 'empty'}, neither text nor a "
                        "conversation (a list of {role, content} messages)" + (
                            "; to write it as text, make data.prompt a template: "
                            f"\"{{{cfg.prompt}}}\"" if prompt else ""))
    # the reply, whose answer a prompt must not hold
    if conversation and not replies and prompt[-1]["role"] == "assistant":
        fix = _reply_in_prompt_fix(cfg, no_gold)
        raise DataError(f"row {i}: data.prompt={cfg.prompt} ends with the assistant's reply, "
                        f"so the answer would be in the prompt; {fix}")
    if no_gold:
        raise MissingField(f"row {i} has no (or an empty) field '{cfg.answer_key}' "
                           "(data.answer_key; null when the rewards need no gold answer); "
                           f"its fields: {', '.join(row)}")
    return {**row, "prompt": prompt, **replies}


def _split_replies(cfg: DataConfig, row: dict, i: int, prompt) -> tuple:
    """(prompt, {reply: text}): SFT's target or DPO's chosen and rejected, each split off the
    prompt they follow (split_reply)."""
    replies = {}
    for reply in ("target", "chosen", "rejected"):
        if column := getattr(cfg, reply):
            # an empty DPO reply (EOS alone)
            empty = reply != "target" and "{" not in column and row.get(column) == ""
            prompt, replies[reply] = split_reply(
                prompt, "" if empty else build_prompt(row, column, i), cfg, i, reply)
            # the prefix counts as prompt
            if cfg.assistant_prefix and replies[reply].startswith(cfg.assistant_prefix):
                raise DataError(f"row {i}: data.{reply} starts with data.assistant_prefix "
                                f"{cfg.assistant_prefix!r}, which the prompt already ends with "
                                "(trained on, it would be doubled); set data.assistant_prefix: "
                                "'' for replies that carry it (tools/bestofn.py's pairs do)")
    return prompt, replies


def _is_conversation(prompt) -> bool:
    """A list of {role, content} messages, each content text or a list of parts."""
    return isinstance(prompt, list) and all(  # content: text, or a list of parts
        isinstance(m, dict) and isinstance(m.get("role"), str) and (  #   ({type: text, text})
            isinstance(m.get("content"), str) or (isinstance(m.get("content"), list)
            and all(isinstance(c, dict) for c in m["content"]))) for m in prompt)


def _reply_in_prompt_fix(cfg: DataConfig, no_gold: bool) -> str:
    """What to do when a conversation prompt ends with the assistant's reply."""
    fix = (f"set data.target: {cfg.prompt} to split it off "
           "(the messages before it are the prompt)"
           if active_mixture(cfg)[1] is None else  # data.target would split every source
           "give this source map: split_messages and prompt: prompt (the reply goes to a "
           "column 'completion')"
           if cfg.prompt == "messages" else
           "give this source a map (data.map) that drops the reply")
    # split_messages makes it
    if no_gold and not (cfg.prompt == "messages" and cfg.answer_key == "completion"):
        fix += f"; and data.answer_key: null, since its rows have no '{cfg.answer_key}'"
    return fix


def split_reply(prompt, target, cfg: DataConfig, i: int, key: str = "target") -> tuple:
    """(prompt, reply text) of an SFT row (or a DPO reply: key chosen, rejected). A reply holding
    chat messages (TRL's conversational formats: `messages`, or a `completion` list) is its last
    message, which must be the assistant's; when data.prompt names the same column, the messages
    before it are the prompt. Messages before the reply in another column are the prompt repeated
    (TRL's implicit prompt), or for SFT a multi-turn completion's earlier turns (a tool call and its
    result), which follow the prompt as context; anything else is refused, never dropped."""
    if not isinstance(target, (list, dict)):
        return prompt, str(target)  # text, or a number column (an answer of 5 is the reply "5")
    last = target[-1] if isinstance(target, list) and target else None
    column = getattr(cfg, key)
    if not (isinstance(last, dict) and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)):
        raise DataError(f"row {i}: data.{key}={column} holds "
                        f"{'a list' if isinstance(target, list) else 'an object'}, not text or "
                        "chat messages ending with the assistant's reply "
                        "({role: assistant, content: ...})")
    before = target[:-1]  # the messages ahead of the reply
    turn = lambda m: m.get("role") if isinstance(m, dict) else None  # noqa: E731
    repeated = before == prompt or (  # ultrafeedback_binarized: text prompt, chat replies
        isinstance(prompt, str) and len(before) == 1 and turn(before[0]) == "user"
        and before[0].get("content") == prompt)
    # the prompt itself, none, or the prompt repeated (TRL's implicit prompt)
    if cfg.prompt == column or not before or repeated:
        return (before if cfg.prompt == column else prompt), last["content"]
    if (key == "target" and isinstance(prompt, list) and prompt
            and turn(before[0]) not in (None, "user") and turn(prompt[-1]) == "user"):
        # a multi-message completion: its earlier turns are context, not dropped
        return prompt + before, last["content"]
    raise DataError(f"row {i}: data.{key}={column} holds messages before its reply that are not "
                    f"the prompt's ({cfg.prompt}); give the reply as one assistant message, or "
                    "the same prompt in every reply column")


# ---------------------------------------------------------------- the order prompts are drawn in


class PromptSampler:
    """Draws row indices, reproducibly and resumably.

    Within a source of n rows, its p-th draw is perm_e[p % n] with e = p // n: each epoch a fresh
    seeded permutation. With several sources (sizes, weights), the global draw p first picks a
    source with probability w_s(progress) / sum_k w_k(progress) by a uniform seeded on (seed, p);
    the caller sets `progress` (0 at the first step, 1 at the last). The whole state is state():
    the global position and each source's position, so a resumed run draws what the
    uninterrupted one drew. The returned indices are into the sources' rows concatenated.
    Under torchrun each process (rank r of `world`) draws every world-th of those draws, from the
    r-th on: the ranks of a step draw, together, the prompts one process would (one source), and
    each rank's state is its own (resample_zero_std draws more on one rank than another).
    """

    def __init__(self, sizes: list[int], seed: int,
                 weights: list[tuple[float, float]] | None = None, rank: int = 0, world: int = 1):
        self.sizes, self.seed, self.rank, self.world = list(sizes), seed, rank, world
        self.weights = weights or [(1.0, 1.0)] * len(self.sizes)
        self.offsets = [sum(self.sizes[:s]) for s in range(len(self.sizes))]
        self.position, self.positions, self.progress = 0, [0] * len(self.sizes), 0.0
        self.counts = [0] * len(self.sizes)  # draws per source since pop_counts()
        self._perms: dict[int, tuple[int, list[int]]] = {}  # source -> (epoch, permutation)

    def _index(self, s: int, p: int) -> int:
        epoch = p // self.sizes[s]
        if self._perms.get(s, (None,))[0] != epoch:
            perm = list(range(self.sizes[s]))
            random.Random((self.seed + 7919 * s) * 1_000_003 + epoch).shuffle(perm)
            self._perms[s] = (epoch, perm)
        return self._perms[s][1][p % self.sizes[s]]

    def _now(self) -> list[float]:
        return [max(0.0, a + (b - a) * self.progress) for a, b in self.weights]

    def shares(self) -> list[float]:
        """Each source's probability now: its weight at this progress over the weights' sum."""
        w = self._now()
        return [x / (sum(w) or 1.0) for x in w]

    def _source(self, p: int) -> int:
        return 0 if len(self.sizes) == 1 else self._mixture_source(p)

    def _mixture_source(self, p: int) -> int:
        """The source of global draw p: by a uniform seeded on (seed, p), each with its weight."""
        w = self._now()
        u, acc = random.Random(f"{self.seed}:{p}").random() * sum(w), 0.0
        for s, ws in enumerate(w):
            acc += ws
            if u < acc:
                return s
        return max(s for s, ws in enumerate(w) if ws > 0)  # u == sum(w) after rounding

    def draw(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            s = self._source(self.position * self.world + self.rank)
            out.append(self.offsets[s] + self._index(s, self.positions[s] * self.world + self.rank))
            self.position += 1
            self.positions[s] += 1
            self.counts[s] += 1
        return out

    def pop_counts(self) -> list[int]:
        counts, self.counts = self.counts, [0] * len(self.sizes)
        return counts

    def state(self) -> dict:
        return {"position": self.position, "positions": list(self.positions),
                "sizes": list(self.sizes)}

    def load_state(self, state: dict | int) -> None:
        if isinstance(state, int):  # checkpoints before mixtures saved the position alone
            state = {"position": state, "positions": [state]}
        if len(state["positions"]) != len(self.sizes):
            raise ConfigError(f"the checkpoint drew from {len(state['positions'])} data sources, "
                              f"this config has {len(self.sizes)}")
        # e.g. a filtering data.map changed
        if "sizes" in state and list(state["sizes"]) != list(self.sizes):
            raise ConfigError(f"the checkpoint drew from data sources of {state['sizes']} rows, "
                              f"this config gives {list(self.sizes)}: the same positions would "
                              "draw other rows; restore the data (or the map, data.skip_long and "
                              "the length limits) it trained on")
        self.position, self.positions = state["position"], list(state["positions"])
