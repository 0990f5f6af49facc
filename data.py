"""Training prompts: a built-in task, local files or a hub dataset, turned into rows (dicts) that
carry a "prompt" plus every column the rewards read, and drawn in a reproducible order.

    rows = load_rows(cfg.data)                 # list[dict], each with row["prompt"]
    sampler = PromptSampler(len(rows), seed)   # sampler.draw(4) -> 4 row indices; sampler.position resumes

`data.prompt` is a column name or a template over the columns ("Q: {question}\\nA) {opa}"; write
literal braces as {{ }}). A row missing a needed field is an error naming the row and the field.
"""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from config import ConfigError, DataConfig


class DataError(ConfigError):
    """A dataset problem the user must fix (missing file, row without a needed field)."""


def arithmetic_task(num_examples: int, seed: int = 1234, max_operand: int = 20) -> list[dict]:
    """The quickstart task, built in code: distinct additions a + b (1 <= a, b <= max_operand) in a
    seeded order, the sum as the gold answer. Distinct, so any two row ranges are disjoint.

    >>> arithmetic_task(2, seed=0)[0]["prompt"]
    'What is 8 + 11? Reply with just the number.'
    """
    pairs = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    if num_examples > len(pairs):
        raise DataError(f"the arithmetic task has {len(pairs)} distinct problems; data.num_examples={num_examples} is too many")
    random.Random(seed).shuffle(pairs)
    return [{"prompt": f"What is {a} + {b}? Reply with just the number.", "answer": str(a + b)}
            for a, b in pairs[:num_examples]]


BUILTIN_TASKS = {"arithmetic": arithmetic_task}


def _read_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        text = path.read_text()
        if suffix == ".json" and text.lstrip().startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not valid JSON ({e.msg}); fix or remove that line") from None
        return rows
    if suffix == ".csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    raise DataError(f"data.name={path}: unsupported file type '{suffix}'; use .jsonl, .json, .csv or .parquet")


def load_raw(cfg: DataConfig) -> list[dict]:
    """Rows as they are stored, before prompts are built."""
    if cfg.name in BUILTIN_TASKS:
        return BUILTIN_TASKS[cfg.name](cfg.num_examples or 400)
    path = Path(cfg.name).expanduser()
    if path.is_file():
        rows = _read_file(path)
    elif cfg.name.startswith((".", "/", "~")) or path.suffix.lower() in (".jsonl", ".json", ".csv", ".parquet"):
        raise DataError(f"data.name={cfg.name}: no such file; give a local data file, a hub dataset id or a built-in task ({', '.join(BUILTIN_TASKS)})")
    else:
        import datasets
        try:
            rows = list(datasets.load_dataset(cfg.name, cfg.config_name, split=cfg.split))
        except Exception as e:  # the hub raises many types; the user needs the first line
            raise DataError(f"could not load hub dataset data.name={cfg.name} (split {cfg.split}): {str(e).splitlines()[0]}") from None
    if cfg.num_examples:
        rows = rows[: cfg.num_examples]
    return rows


def build_prompt(row: dict, template: str, index: int) -> str:
    """A column's value, or the template filled from the row's columns."""
    if "{" not in template:
        if row.get(template) in (None, ""):
            raise DataError(f"row {index} has no (or an empty) field '{template}'; its fields: {', '.join(row)}")
        return row[template]
    empty = [f for f in row if row[f] in (None, "") and "{" + f + "}" in template]
    if empty:  # a null would be rendered as the text "None"
        raise DataError(f"row {index} has an empty field '{empty[0]}' used in the template {template!r}")
    try:
        return template.format_map(row)
    except KeyError as e:
        raise DataError(f"row {index} has no field {e} used in the data.prompt template; its fields: {', '.join(row)}") from None
    except (ValueError, IndexError, AttributeError) as e:
        raise DataError(f"data.prompt template {template!r} is malformed ({e}); use {{column}} and write literal braces as {{{{ }}}}") from None


def split(rows: list, seed: int | None, select: list[int] | None) -> list:
    """Shuffle with `seed` (None: keep the order), then keep rows [start, end). Disjoint ranges of
    the same seed give disjoint splits, reproducibly (MedMCQA: 0-1000 SFT, 1000-1500 GRPO, 1500-1700 eval).

    >>> split(list(range(10)), 42, [0, 3]) == split(list(range(10)), 42, [0, 3]), split(list(range(5)), None, [1, 3])
    (True, [1, 2])
    """
    order = list(range(len(rows)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    if select is not None:
        if select[1] > len(rows):
            raise DataError(f"select {select} reaches past the {len(rows)} rows of the dataset")
        order = order[select[0]:select[1]]
    return [rows[i] for i in order]


def load_rows(cfg: DataConfig, select: list[int] | None = None) -> list[dict]:
    """Load, split (`select` overrides cfg.select, e.g. eval.select) and check every row up front,
    so a bad row stops the run before anything is written."""
    rows = split(load_raw(cfg), cfg.split_seed, select if select is not None else cfg.select)
    if not rows:
        raise DataError(f"data.name={cfg.name} holds no rows")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"row {i} of {cfg.name} is not an object with fields")
        if cfg.answer_key and row.get(cfg.answer_key) in (None, ""):
            raise DataError(f"row {i} has no (or an empty) field '{cfg.answer_key}' (data.answer_key); its fields: {', '.join(row)}")
        prompt = build_prompt(row, cfg.prompt, i)
        if not isinstance(prompt, (str, list)) or not prompt:
            raise DataError(f"row {i}: the prompt is empty or not text")
        extra = {"target": str(build_prompt(row, cfg.target, i))} if cfg.target else {}
        out.append({**row, "prompt": prompt, **extra})
    return out


class PromptSampler:
    """Draws row indices epoch by epoch, each epoch a fresh seeded permutation.

    The whole state is `position` (rows drawn so far): index p is perm(seed + p // n)[p % n],
    so a resumed run that restores `position` draws exactly what the uninterrupted run drew.
    """

    def __init__(self, num_rows: int, seed: int, position: int = 0):
        self.num_rows, self.seed, self.position = num_rows, seed, position
        self._epoch, self._perm = -1, []

    def _index(self, p: int) -> int:
        epoch = p // self.num_rows
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, list(range(self.num_rows))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._perm)
        return self._perm[p % self.num_rows]

    def draw(self, k: int) -> list[int]:
        out = [self._index(p) for p in range(self.position, self.position + k)]
        self.position += k
        return out
