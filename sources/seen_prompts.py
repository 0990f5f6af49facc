"""Held-out rows a model was trained on, found by content: each run records a hash of every prompt
it trains on, with those of the runs behind model.name (a merged export) and model.init_adapter,
and eval.py (and train.py, for run.eval_every) counts the held-out rows among them, whatever the
configs' selects, seeds and file names say.

    record(run_dir, rows, cfg.model, resumed)        # train.py, with its first checkpoint:
                                                     # run_dir/trained_prompts.txt
    seen = recorded_for("runs/sft/checkpoints/step_000100/adapter")   # its run's hashes, or None
    count(held_out_rows, seen)                       # how many held-out rows have a prompt in it

A prompt is its text (a conversation: its messages as JSON) with runs of whitespace as one space.
The file is written atomically, and a resumed run adds to it (a changed data.select trains on both).
tools/export.py copies it next to a merged model. Models from other tools have none: eval.py then
compares configs instead (entries.trained_on_held_out).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from files import jsonl

FILE = "trained_prompts.txt"


def prompt_hash(row: dict) -> str:
    """16 hex digits of the row's prompt, whitespace evened out.

    >>> prompt_hash({"prompt": "What is 2 + 3?"}) == prompt_hash({"prompt": " What is  2 + 3?\\n"})
    True
    """
    p = row["prompt"]
    text = p if isinstance(p, str) else json.dumps(p, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]


def recorded_file(path: str | Path) -> Path | None:
    """The trained_prompts.txt of the run (or export) that made `path`: a run directory, a
    checkpoint, its adapter/ or model/, or an export's directory; None when there is none."""
    p = Path(path).expanduser()
    for q in dict.fromkeys([p.absolute(), p.resolve()]):  # a symlinked checkpoint: its own run too
        ckpt = q.parent if q.name in ("adapter", "model") else q
        # run/checkpoints/step_N[/adapter]
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
        for d in (q, run):  # not any folder above: a model under a run's folder is not that run's
            if d is not None and (d / FILE).is_file():
                return d / FILE
    return None


def read(f: str | Path) -> set[str]:
    """The hashes a trained_prompts.txt holds."""
    return set(Path(f).read_text(encoding="utf-8").split())


def recorded_for(path: str | Path) -> set[str] | None:
    f = recorded_file(path)
    return read(f) if f else None


def seen_before(mcfg) -> set[str]:
    """What the runs behind the model a run starts from recorded: model.name's (a merged export, in
    a local directory or pushed to the hub) and model.init_adapter's, chains included."""
    seen = set()
    for name in (mcfg.name, mcfg.init_adapter):
        if name and Path(name).expanduser().exists():
            seen |= recorded_for(name) or set()
        elif name and name == mcfg.name and name.count("/") == 1:  # a hub repo (a pushed export)
            try:  # its record, cached or fetched (a few KB); offline or a repo without one: none
                from huggingface_hub import hf_hub_download

                from sources.hub import offline_if_unreachable
                with offline_if_unreachable():
                    f = hf_hub_download(name, FILE, revision=mcfg.revision)
            except Exception:
                f = None
            if isinstance(f, str):
                seen |= read(f)
    return seen


def record(run_dir: Path, rows: list[dict], mcfg, resumed: bool = False) -> set[str]:
    """Write run_dir/trained_prompts.txt: these rows' prompts, those of the runs behind the model
    (seen_before), and, resumed, those already there -> the set written. train.py writes it with a
    run's first checkpoint of a process: what a checkpoint holds is what it trained on."""
    f = Path(run_dir) / FILE
    hashes = {prompt_hash(r) for r in rows} | seen_before(mcfg) | (
        (recorded_for(run_dir) or set()) if resumed and f.is_file() else set())
    jsonl.write_atomic(f, "".join(h + "\n" for h in sorted(hashes)))
    return hashes


def count(rows: list[dict], seen: set[str]) -> int:
    """How many of rows have a prompt in seen."""
    return sum(prompt_hash(r) in seen for r in rows)
