"""Best-of-n data from eval.py's predictions: each prompt's best completion as SFT data (rejection
sampling / RAFT: sample n, keep the best, fine-tune on it), and its best against its worst as
preference pairs (TRL's prompt / chosen / rejected, for DPO).

    python eval.py --config my_task.yaml --models grpo=runs/grpo --eval.num_samples=4 \\
        --eval.temperature=0.8 --data.select=null '--eval.select=[0,1000]' \\
        --eval.out_dir=runs/samples   # training rows: held-out ones would leak
    python -m tools.bestofn runs/samples/predictions_grpo.jsonl --sft best.jsonl \\
        --pairs pairs.jsonl --min-reward 1.0
    python train.py --config my_task.yaml --mode=sft --data.name=best.jsonl --data.prompt=prompt \\
        --data.target=completion --data.answer_key=null --data.map=null --data.split_seed=null \\
        --data.select=null --data.num_examples=0 --eval.select=null --run.out_dir=runs/raft

People's ratings serve too: `python -m tools.ratings export --dir DIR > rated.jsonl` (or the rating
page's /api/export, a JSON list, or its Parquet) writes each rated reply with its reward (the human
reward's value), and `bestofn.py rated.jsonl --pairs ...` pairs each prompt's best- and worst-rated
replies. Those replies carry any forced prefix in their
text (the raters saw it), so both outputs train with data.assistant_prefix: ''.

A prompt is its predictions' (source, row), or a rated reply's prompt text. Completions without a
reward (a failed API request, a reward with fallback: skip that failed) are never picked, nor is one
cut at max_new_tokens (`truncated`; SFT on it would teach stopping mid-thought) unless
--keep-truncated. The best completion is kept, as SFT row or as a pair's chosen, when its reward
>= --min-reward (BioReasoner's "auto_score < 2.5: reject" with auto_score as the reward); a pair
is kept when best - worst >= --min-margin too (> 0: a tie is no preference). --require NAME=V
keeps only completions whose reward NAME is >= V (e.g. think_format=1: never pick a reply without
its think block; auto_score=2.5 bars the chosen when --by ranks on other rewards); the rejected one
may miss it. --by NAME+NAME ranks by those rewards' sum instead of the
total (BioReasoner's pairs: the judge's logic+novelty decide, and with think_format among them a
reply without its think block ranks low); the rows' reward stays the total, and the sum is written
as by_reward (chosen_/rejected_by_reward). SFT rows hold `completion`, the text after the forced
prefix the eval recorded (`assistant_prefix`): train them with the same data.assistant_prefix, which
SFT puts back. Pairs are in TRL's form, for its DPOTrainer or minigrpo's `mode: dpo` (with
data.assistant_prefix: ''), so their chosen and rejected include that prefix (a forced <think>);
their prompt is the user prompt as built by data.prompt, without data.system_prompt. Outputs are
written atomically and never overwritten; nothing is written when a requested output would be empty.

Pair sets from several judges merge into one, a pair per prompt (BioReasoner's v2.2: "35 unique
pairs, deduplicated by prompt_id, highest delta"):

    python -m tools.bestofn merge opus_pairs.jsonl codex_pairs.jsonl --key prompt_id \\
        --out data/dpo_v22_merged.jsonl

--key names a column of the pair, or of its `columns` (eval.keep_columns, which bestofn's own pairs
carry there: eval.py with --eval.keep_columns=[prompt_id] makes pairs that merge by prompt_id).
A pair's delta is chosen_by_reward - rejected_by_reward when it has them (--by), else
chosen_reward - rejected_reward, else `delta` (a column of your own pairs); a pair without one
(a hand-written exemplar) ranks below every pair with one. Equal deltas: the first given wins.
The deltas of two judges are compared as they are, so put them on one scale first.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from files import command, jsonl
from settings.typed_config import check_writable


def groups(records: list[dict]) -> dict[tuple, list[dict]]:
    """Predictions by prompt: (source, row) -> its completions, in file order; records without a row
    (tools.ratings export's rated
    replies) by what they were rated on: (None, [prompt, criteria, scale]
    as JSON), so rewards on other criteria or scales are never compared."""
    out: dict[tuple, list[dict]] = {}
    for r in records:
        key = ((r.get("source"), r["row"]) if "row" in r
               else (None, json.dumps([r["prompt"], r.get("criteria"), r.get("scale")])))
        out.setdefault(key, []).append(r)
    return out


def ranked_by(rec: dict, by: list[str] | None = None) -> float | None:
    """What a completion is ranked by: its reward, or with `by` the sum of those rewards alone (None
    when one is missing), e.g. a judge's logic + novelty without the citation counts in the total.

    >>> ranked_by({"reward": 3.5, "rewards": {"logic": 4, "novelty": 2, "cites": 1}},
    ...           ["logic", "novelty"])
    6.0
    """
    if rec.get("api_failed"):
        return None
    if not by:
        return rec.get("reward")
    values = [(rec.get("rewards") or {}).get(k) for k in by]
    return None if any(v is None for v in values) else float(sum(values))


def eligible(rec: dict, require: dict[str, float], keep_truncated: bool = False,
             by: list[str] | None = None) -> bool:
    """Has a reward (the `by` ones), was not cut at max_new_tokens (unless keep_truncated), and
    every required reward reaches its bar."""
    if ranked_by(rec, by) is None or (rec.get("truncated") and not keep_truncated):
        return False
    return all((rec.get("rewards") or {}).get(k) is not None and rec["rewards"][k] >= v
               for k, v in require.items())


def select(records: list[dict], min_reward: float | None = None, min_margin: float = 1e-9,
           require: dict[str, float] | None = None, keep_truncated: bool = False,
           by: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """-> (SFT rows: each prompt's best, pairs: each prompt's best vs worst). The best is the first
    of the highest reward (file order), the worst the first of the lowest; `by`: ranked by the sum
    of those rewards instead (ranked_by), which min_reward and min_margin then apply to. Both
    outputs keep a best below min_reward out: an SFT row, or a pair's chosen.

    >>> recs = [{"row": 0, "prompt": "p", "completion": c, "reward": r}
    ...         for c, r in [("a", 0.0), ("b", 1.0), ("c", 1.0)]]
    >>> sft, pairs = select(recs, min_reward=0.5)
    >>> sft[0]["completion"], pairs[0]["chosen"], pairs[0]["rejected"]
    ('b', 'b', 'a')
    """
    require = require or {}
    sft, pairs = [], []
    for (source, row), recs in groups(records).items():
        ok = [r for r in recs if eligible(r, require, keep_truncated, by)]
        if not ok:
            continue
        best = max(ok, key=lambda r: ranked_by(r, by))  # max/min keep the first of equals
        worst = min([r for r in recs if ranked_by(r, by) is not None],
                    key=lambda r: ranked_by(r, by))
        where = {**({"row": row} if "row" in best else {}),  # columns: eval.keep_columns, nested
                 **({"source": source} if source is not None else {}),
                 **({"columns": best["columns"]} if best.get("columns") else {})}
        forced = best.get("assistant_prefix") or ""
        prefix = {"assistant_prefix": forced} if forced else {}
        high, low = ranked_by(best, by), ranked_by(worst, by)
        # reward stays the total; the --by sums go under their own keys
        named = {"by": "+".join(by)} if by else {}
        if min_reward is not None and high < min_reward:  # neither an SFT row nor a chosen reply
            continue
        sft.append({**where, "prompt": best["prompt"], **prefix,
                    "completion": best["completion"], "reward": best.get("reward"),
                    **({**named, "by_reward": high} if by else {})})
        if high - low >= min_margin and best["completion"] != worst["completion"]:
            pairs.append({
                **where, "prompt": best["prompt"], **prefix, "chosen": forced + best["completion"],
                "rejected": forced + worst["completion"], "chosen_reward": best.get("reward"),
                "rejected_reward": worst.get("reward"),
                **({**named, "chosen_by_reward": high, "rejected_by_reward": low} if by else {})})
    return sft, pairs


def read_records(path: str) -> list:
    """eval.py's predictions, the rated replies (tools.ratings export, the rating page's /export and
    /api/export) or pairs: JSON Lines or one JSON list, read as every tool reads the others' files
    (jsonl.load: strict, never skipped as unfinished), or Parquet (--out x.parquet,
    ?format=parquet)."""
    if Path(path).suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    return jsonl.load(path)


def parse_require(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ValueError(f"--require {item!r}: write NAME=VALUE, e.g. think_format=1")
    return out


def pair_delta(pair: dict) -> float | None:
    """How strongly a pair prefers its chosen reply: the --by sums' difference, else the rewards',
    else its own `delta` column; None when it has none of them.

    >>> pair_delta({"chosen_reward": 3.0, "rejected_reward": 1.0, "chosen_by_reward": 8.0,
    ...             "rejected_by_reward": 5.0}), pair_delta({"delta": 2}), pair_delta({})
    (3.0, 2.0, None)
    """
    for high, low in (("chosen_by_reward", "rejected_by_reward"),
                      ("chosen_reward", "rejected_reward")):
        if isinstance(pair.get(high), (int, float)) and isinstance(pair.get(low), (int, float)):
            return float(pair[high] - pair[low])
    delta = pair.get("delta")
    return float(delta) if isinstance(delta, (int, float)) and not isinstance(delta, bool) else None


def key_of(pair: dict, key: str):
    """The pair's value of the --key column: its own, else the one under `columns` (eval.py's
    keep_columns, where bestofn writes them); None when it has neither.

    >>> key_of({"prompt_id": 3}, "prompt_id"), key_of({"columns": {"prompt_id": 4}}, "prompt_id")
    (3, 4)
    """
    if pair.get(key) is not None:
        return pair[key]
    columns = pair.get("columns")
    return columns.get(key) if isinstance(columns, dict) else None


def merge_pairs(pair_sets: list[list[dict]], key: str) -> list[dict]:
    """One pair per value of `key`: the one with the highest pair_delta (None below any number;
    on a tie, the first in the order given), in the order the values first appear.

    >>> a = [{"prompt_id": 1, "delta": 1}, {"prompt_id": 2, "delta": 3}]
    >>> b = [{"prompt_id": 1, "delta": 2}, {"prompt_id": 3}]
    >>> [(p["prompt_id"], p.get("delta")) for p in merge_pairs([a, b], "prompt_id")]
    [(1, 2), (2, 3), (3, None)]
    """
    best: dict[str, dict] = {}
    for pairs in pair_sets:
        for pair in pairs:
            k = json.dumps(key_of(pair, key), sort_keys=True)
            new, old = pair_delta(pair), pair_delta(best[k]) if k in best else None
            if k not in best or (new is not None and (old is None or new > old)):
                best[k] = pair
    return list(best.values())


def read_pair_sets(paths: list[str], key: str) -> list[list[dict]]:
    """Each pair file's pairs; ValueError naming the file and line of one that is not a pair or
    has no `key` to merge by."""
    sets = []
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such file")
        pairs = read_records(path)
        for n, pair in enumerate(pairs, 1):
            if not (isinstance(pair, dict) and {"chosen", "rejected"} <= set(pair)):
                raise ValueError(f"{path}:{n}: not a pair (chosen, rejected)")
            if key_of(pair, key) is None:
                kept = pair.get("columns") if isinstance(pair.get("columns"), dict) else {}
                raise ValueError(f"{path}:{n}: no '{key}' to merge by (--key); it has: "
                                 f"{', '.join(k for k in pair if k != 'columns')}"
                                 + (f"; under columns: {', '.join(kept)}" if kept else ""))
        sets.append(pairs)
    return sets


@command.one_line(ValueError, OSError)  # ConfigError (check_writable) is a ValueError
def merge_main(argv: list[str]) -> int:
    """`python -m tools.bestofn merge A.jsonl B.jsonl --out C.jsonl [--key prompt_id]`."""
    ap = argparse.ArgumentParser(prog="python -m tools.bestofn merge",
                                 description="merge pair sets: one pair per --key, the highest "
                                 "delta (chosen - rejected reward)")
    ap.add_argument("pairs", nargs="+",
                    help="pair files (JSON Lines or a JSON list: prompt, chosen, rejected)")
    ap.add_argument("--out", required=True, help="the merged pairs (never overwritten)")
    ap.add_argument("--key", default="prompt", help="the column that names a pair's prompt, "
                    "the pair's own or under its columns (eval.keep_columns) (default: prompt, "
                    "its text; the original project's: prompt_id)")
    args = ap.parse_args(argv)
    if Path(args.out).exists():
        raise ValueError(f"{args.out} exists; give a new file (outputs are never overwritten)")
    check_writable(args.out, "--out")
    sets = read_pair_sets(args.pairs, args.key)
    merged = merge_pairs(sets, args.key)
    if not merged:
        raise ValueError(f"{', '.join(args.pairs)}: no pairs")
    jsonl.write_records(args.out, merged)
    print(f"[bestofn] {args.out}: {len(merged)} unique pairs (deduplicated by {args.key}, highest "
          f"delta) from {sum(map(len, sets))} pairs in {len(sets)} files")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bestofn",
                                 epilog="python -m tools.bestofn merge A B --out C: merge pair "
                                 "sets (see merge --help)",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("predictions", nargs="+", help="eval.py's predictions_<name>.jsonl (several: "
                    "pooled per (source, row)) or tools.ratings export's rated replies (pooled per "
                    "prompt, criteria and scale; never with predictions)")
    ap.add_argument("--sft",
                    help="write each prompt's best completion here (prompt, completion, reward)")
    ap.add_argument("--pairs", help="write best-vs-worst pairs here (prompt, chosen, rejected)")
    ap.add_argument("--min-reward", type=float, default=None,
                    help="keep a best completion (SFT row, or a pair's chosen) only from this "
                         "reward up")
    ap.add_argument("--min-margin", type=float, default=1e-9,
                    help="pairs: keep only when best - worst >= this")
    ap.add_argument("--require", nargs="*", default=[], metavar="NAME=V",
                    help="only completions whose reward NAME >= V")
    ap.add_argument("--keep-truncated", action="store_true",
                    help="also pick completions cut at max_new_tokens")
    ap.add_argument("--by", default=None, metavar="NAME[+NAME...]", help="rank by the sum of these "
                    "rewards, not the total (e.g. logic+novelty: a judge's scores without the rule "
                    "rewards); --min-reward/--min-margin apply to it")
    return ap.parse_args(argv)


def check_outputs(sft: str | None, pairs: str | None) -> None:
    """At least one output, two different files, neither there yet, both writable: checked before
    either is written, so never one file without the other."""
    if not (sft or pairs):
        raise ValueError("nothing to write: give --sft FILE, --pairs FILE or both")
    outs = [Path(o).resolve() for o in filter(None, [sft, pairs])]
    if len(set(outs)) < len(outs):
        raise ValueError("--sft and --pairs name the same file; give each its own")
    for flag, out in (("--sft", sft), ("--pairs", pairs)):
        if out and Path(out).exists():
            raise ValueError(f"{out} exists; give a new file (outputs are never overwritten)")
        if out:
            check_writable(out, flag)


def check_record(rec, where: str) -> None:
    """eval.py's predictions (row, prompt, completion) or tools.ratings export's rated replies
    (prompt, completion, scores, reward), a text completion and a numeric or null reward; else
    ValueError at `where` (path:line). A file from an older minigrpo fails here too: the message
    says to make it again."""
    if not (isinstance(rec, dict) and {"prompt", "completion"} <= set(rec)
            and ("row" in rec or {"scores", "reward"} <= set(rec))):
        raise ValueError(f"{where}: neither eval.py's predictions (row, prompt, completion, "
                         "reward) nor tools.ratings export's rated replies (prompt, completion, "
                         "scores, reward); from an older minigrpo? run eval.py again, or export "
                         "them again (python -m tools.ratings export --dir ...)")
    reward = rec.get("reward")
    if not isinstance(rec["completion"], str) or not (
            reward is None or (isinstance(reward, (int, float)) and not isinstance(reward, bool))):
        raise ValueError(f"{where}: the completion must be text and the reward a number or null, "
                         f"got {type(rec['completion']).__name__} and {reward!r}")


def read_predictions(paths: list[str]) -> list[dict]:
    """Every record of the files, in order, each checked (check_record); ValueError when a file is
    missing or none holds a record."""
    records = []
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such file (eval.py writes "
                             "eval.out_dir/predictions_<name>.jsonl)")
        for n, rec in enumerate(read_records(path), 1):
            check_record(rec, f"{path}:{n}")
            records.append(rec)
    if not records:
        raise ValueError(f"{', '.join(paths)}: no predictions")
    return records


def check_reward_names(records: list[dict], require: dict[str, float],
                       by: list[str] | None) -> None:
    """--by names each reward once, and every --require and --by name is a reward the predictions
    have (under 'rewards')."""
    if by and len(set(by)) < len(by):
        raise ValueError(f"--by {'+'.join(by)} names a reward twice; a weight belongs in eval's "
                         "rewards: list")
    named = {k for r in records for k in (r.get("rewards") or {})}
    for flag, names in (("--require", require), ("--by", by or [])):
        if unknown := sorted(set(names) - named):
            raise ValueError(f"{flag} {unknown[0]}: no prediction has a reward of that name; "
                             f"they have: {', '.join(sorted(named)) or 'none'} (eval.py "
                             "writes each reward under 'rewards')")


def write_outputs(args: argparse.Namespace, records: list[dict], sft: list[dict],
                  pairs: list[dict]) -> int:
    """Each requested output with a line on it -> 0; when one would be empty, exit 1 and nothing
    is written."""
    if empty := [flag for flag, path, rows in
                 (("--sft", args.sft, sft), ("--pairs", args.pairs, pairs)) if path and not rows]:
        return command.error(f"nothing passed the bars for {' and '.join(empty)} (see "
                             "--min-reward, --min-margin, --require, --keep-truncated); nothing "
                             "was written", code=1)
    prompts = len(groups(records))
    picked = "by_reward" if args.by else "reward"  # what they were picked by
    for path, rows, what, key in [(args.sft, sft, "best completions", picked),
                                  (args.pairs, pairs, "pairs", "chosen_" + picked)]:
        if path:
            jsonl.write_records(path, rows)
            mean = sum(r[key] for r in rows) / len(rows)
            print(f"[bestofn] {path}: {len(rows)} {what} from {prompts} prompts "
                  f"(mean {args.by or 'reward'} of the kept {mean:.3f})")
    scored = [r["reward"] for r in records if r.get("reward") is not None]
    if scored:
        print(f"[bestofn] mean reward of all {len(scored)} scored completions: "
              f"{sum(scored) / len(scored):.3f}")
    return 0


@command.one_line(ValueError, OSError)  # ConfigError (check_writable) is a ValueError
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = parse_args(argv)
    check_outputs(args.sft, args.pairs)
    require = parse_require(args.require)
    records = read_predictions(args.predictions)
    by = args.by.split("+") if args.by else None
    check_reward_names(records, require, by)
    sft, pairs = select(records, args.min_reward, args.min_margin, require, args.keep_truncated,
                        by)
    return write_outputs(args, records, sft, pairs)


if __name__ == "__main__":
    sys.exit(main())
