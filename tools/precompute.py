"""Pre-compute the answers a rubric is judged on (GRubrics): K answers to each question from an
answer policy (any OpenAI-compatible model), and each answer's gold score, written once to the file
that rubric_alignment training reads.

    python -m tools.precompute --config configs/grubrics.yaml \\
        --precompute.questions=data/healthbench.jsonl --precompute.map=healthbench \\
        --precompute.out=data/cache/grubrics_open.jsonl
    python -m tools.precompute --config configs/grubrics.yaml \\
        --precompute.questions=GBaker/MedQA-USMLE-4-options --precompute.map=medqa \\
        --precompute.out=data/cache/grubrics_verifiable.jsonl --precompute.limit=300 \\
        --precompute.system_prompt="Answer the question. End with: The answer is <letter>." \\
        --precompute.gold_reward="{name: choice_accuracy, args: \\
            {fallback_pattern: '[Aa]nswer is\\W*([A-D])\\b'}}"

Settings are the config's `precompute:` section (see config.py; configs/grubrics.yaml has one).
Gold scores, one per answer:
  by the judge (default): the judge: section grades the answer under the row's expert rubric
      (precompute.rubric_key) with precompute.template, the same prompt rubric_alignment uses in
      training; gold = (score - score_min) / (score_max - score_min), in [0, 1]
  by the judge per criterion (precompute.criteria_key: rubrics, HealthBench's physicians' criteria
      with their points): met or not, one call each (precompute.criteria_template), and gold = the
      points met / the positive points, clipped to [0, 1], as HealthBench scores; then --validate
      (the judge's one grade under the whole rubric against that gold) measures something, not 1.0
      by construction
  by a rule (precompute.gold_reward): that reward of the answer, e.g. choice_accuracy (1 or 0)
A question is left out, and counted, when one of its answer requests or grades failed, or (unless
precompute.keep_constant) when its K gold scores are all equal: rubric_alignment scores such a
question 0 whatever the rubric, so it only costs judge calls.

Nothing paid for is lost: every answer is cached in precompute.answers.cache_path and every grade in
judge.cache_path (append-only, fsynced, both required), so a killed run is rerun with the same
command, and one with failed requests (which wrote its file) into a new precompute.out, each paying
only for what it lacked. precompute.out is written atomically at the end, and an existing one is
never overwritten.

    python -m tools.precompute --config configs/grubrics.yaml \\
        --validate data/cache/grubrics_open.jsonl

--validate scores the expert rubrics themselves: rubric_alignment of each row's
precompute.rubric_key against its gold_scores, through the judge: section, as training scores a
generated rubric. Its mean is the ceiling a trained rubric is measured against; with gold scores
from people, it says how far the judge agrees with them. It writes nothing but the judge's cache.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from api.client import Judge
from config import Config, ConfigError, DataConfig, JudgeUnusable, PrecomputeConfig, load_config
from data import DataError, build_prompt, check_not_data_file, load_raw, mapped_rows
from files import command, jsonl
from judge import criteria_gold, criteria_row_fields, grade_answers, load_template, rubric_alignment
from rewards import compute_rewards
from rollout import chat_messages
from scoring.checks import check_rows, check_specs
from settings.typed_config import check_writable


def check(cfg: Config) -> PrecomputeConfig:
    """Every precompute setting checked before a request is sent; ConfigError names the key."""
    p = cfg.precompute
    for key in ("questions", "out", "answers"):
        if getattr(p, key) is None:
            raise ConfigError(f"precompute.{key} is not set (see tools/precompute.py's docstring)")
    if p.num_answers < 2:
        raise ConfigError(f"precompute.num_answers={p.num_answers}: a rubric needs at least 2 "
                          "answers to rank")
    if p.answers.temperature == 0:
        raise ConfigError("precompute.answers.temperature is 0: the K answers would repeat one; "
                          "set one (0.7-1.0) or null (the model's default)")
    if not p.answers.model:
        raise ConfigError("precompute.answers.model is not set: name the model that answers the "
                          "questions")
    caches = {"precompute.answers.cache_path": p.answers.cache_path}
    if p.gold_reward is not None and p.criteria_key:
        raise ConfigError("precompute.gold_reward and precompute.criteria_key both choose how gold "
                          "is scored: set one")
    if p.gold_reward is not None:
        try:
            check_specs([p.gold_reward], judges=[])
        except ValueError as e:
            raise ConfigError(f"precompute.gold_reward: {e}") from None
    else:
        if cfg.judge is None:
            raise ConfigError("gold scores by the judge need a judge: section (or set "
                              "precompute.gold_reward)")
        for key in ("criteria_template",) if p.criteria_key else ("template",):
            try:
                load_template(getattr(p, key))
            except ValueError as e:
                raise ConfigError(f"precompute.{key}: {e}") from None
        caches["judge.cache_path"] = cfg.judge.cache_path
    for key, path in caches.items():
        if not path:
            raise ConfigError(f"{key} is not set: every request is paid for, so give it a file to "
                              "be cached in")
        check_not_data_file(cfg.data, path, key)
        check_writable(path, key)
        if Path(path).resolve() in (Path(p.out).resolve(), Path(p.questions).resolve()):
            raise ConfigError(f"{key}={path} is precompute.out or precompute.questions; give the "
                              "cache a file of its own")
    check_writable(p.out, "precompute.out")  # before anything is paid for, not after
    if Path(p.out).exists():
        raise ConfigError(f"precompute.out={p.out} exists and is never overwritten; write a new "
                          "file (everything paid for is cached, so a rerun into a new file costs "
                          "nothing more)")
    return p


def load_questions(p: PrecomputeConfig) -> list[dict]:
    """The question rows, mapped (precompute.map), each with the text asked under "_question"."""
    raw = load_raw(DataConfig(name=p.questions, config_name=p.config_name, split=p.split,
                              num_examples=p.limit), "precompute.questions")
    rows = mapped_rows(raw,
                       f"precompute.questions={p.questions}", p.map, key="precompute.map")
    # the judge's template, when it scores gold
    template = "criteria_template" if p.criteria_key else "template"
    reads = set() if p.gold_reward is not None else (
        criteria_row_fields(p.criteria_template) if p.criteria_key
        else rubric_alignment.row_fields(template=p.template))
    out = []
    for i, row in rows:  # i: the row's place before a filtering map
        try:
            out.append({**row, "_question": build_prompt(row, p.question, i)})
        except DataError as e:
            raise DataError(f"precompute.question={p.question!r}: {e}") from None
        if p.criteria_key:
            check_criteria(row.get(p.criteria_key), i, p.criteria_key)
        elif p.gold_reward is None and row.get(p.rubric_key) in (None, "", []):
            raise DataError(f"row {i} has no {p.rubric_key!r} (precompute.rubric_key) to grade its "
                            f"answers by; its fields: {', '.join(row)}")
        if p.gold_reward is None and (missing := sorted(reads - row.keys())):
            raise DataError(f"precompute.{template} reads {{{missing[0]}}}, which row {i} lacks; "
                            f"its fields: {', '.join(row)}")
    return out


def check_criteria(criteria, i: int, key: str) -> None:
    """A row's criteria for precompute.criteria_key: [{criterion: text, points: number}, ...],
    some positive."""
    ok = isinstance(criteria, list) and criteria and all(
        isinstance(c, dict) and isinstance(c.get("criterion"), str) and c["criterion"].strip()
        and isinstance(c.get("points"), (int, float)) and not isinstance(c["points"], bool)
        and math.isfinite(c["points"])
        for c in criteria)
    if not ok:
        raise DataError(f"row {i}: precompute.criteria_key={key} must hold a list of "
                        f"{{criterion: text, points: number}} (HealthBench's rubrics), "
                        f"got {str(criteria)[:120]}")
    if not any(c["points"] > 0 for c in criteria):
        raise DataError(f"row {i}: none of its {key} has positive points, so no answer could "
                        "score above 0")


def gold_scores(cfg: Config, judge: Judge | None, rows: list[dict],
                answers: list[list[str]]) -> list[list[float | None]]:
    """Each answer's gold score (None where it could not be had), by the judge or by the rule."""
    p = cfg.precompute
    samples = [{**r, "question": r["_question"], "answers": a} for r, a in zip(rows, answers)]
    if p.criteria_key:
        return criteria_gold(judge, [r[p.criteria_key] for r in rows], samples,
                             template=p.criteria_template)
    if p.gold_reward is None:
        span = judge.cfg.score_max - judge.cfg.score_min
        graded = grade_answers(judge, [r[p.rubric_key] for r in rows], samples, template=p.template)
        return [[None if v is None else (v - judge.cfg.score_min) / span for v in g]
                for g in graded]
    flat = [(a, s) for s in samples for a in s["answers"]]
    res = compute_rewards([a for a, _ in flat], [s for _, s in flat],
                          [dataclasses.replace(p.gold_reward, fallback="skip")])
    values = next(iter(res.per_reward.values()))
    k = p.num_answers
    return [values[i:i + k] for i in range(0, len(values), k)]


def keep(answers: list[str | None], gold: list[float | None], keep_constant: bool) -> str | None:
    """Why a question is left out (None: it is kept)."""
    if any(a is None for a in answers):
        return "a failed answer request"
    if any(g is None or not math.isfinite(g) for g in gold):
        return "a failed gold score"
    if not keep_constant and len(set(gold)) < 2:
        return "equal gold scores (nothing to rank)"
    return None


def open_client(section, key: str, label: str) -> Judge:
    """A client for a config section; its own checks (api_key_env, headers, Azure) as ConfigError
    naming `key`."""
    try:
        return Judge(section, label=label, key=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None  # it names the section


ROWS_PER_BATCH = 16  # questions answered, then graded, before the next ones: a line after each


def batch_line(done: int, total: int, seconds: float, graded: bool) -> str:
    """Where the run stands after a batch of questions.

    >>> batch_line(16, 64, 30.0, graded=True)
    '[precompute] 16/64 questions answered and graded (30 s, about 90 s left)'
    """
    left = f", about {seconds / done * (total - done):.0f} s left" if done < total else ""
    return (f"[precompute] {done}/{total} questions answered{' and graded' if graded else ''} "
            f"({seconds:.0f} s{left})")


def answer_and_grade(cfg: Config, policy: Judge, judge: Judge | None, rows: list[dict],
                     asks: list) -> tuple[list[list[str | None]], list[list[float | None]]]:
    """-> (K answers per question, their gold scores), ROWS_PER_BATCH questions at a time with a
    line after each batch (a long run says so); a question with a failed answer is not graded."""
    k = cfg.precompute.num_answers
    answers: list[list[str | None]] = []
    gold: list[list[float | None]] = []
    t0 = time.monotonic()
    for b in range(0, len(rows), ROWS_PER_BATCH):
        replies = policy.complete_many(asks[b:b + ROWS_PER_BATCH], n=k)
        part = [replies[i:i + k] for i in range(0, len(replies), k)]
        answered = [i for i, a in enumerate(part) if None not in a]
        graded = gold_scores(cfg, judge, [rows[b + i] for i in answered],
                             [part[i] for i in answered]) if answered else []
        scores = dict(zip(answered, graded))
        answers += part
        gold += [scores.get(i, [None] * k) for i in range(len(part))]
        print(batch_line(len(answers), len(rows), time.monotonic() - t0, judge is not None),
              file=sys.stderr, flush=True)
    return answers, gold


def kept_records(rows: list[dict], answers: list[list[str | None]],
                 gold: list[list[float | None]],
                 keep_constant: bool) -> tuple[list[dict], dict[str, int]]:
    """-> (the output's records: each kept question with its answers and gold scores, how many
    were left out for each reason (keep))."""
    left_out: dict[str, int] = {}
    records = []
    for r, a, g in zip(rows, answers, gold):
        why = keep(a, g, keep_constant)
        if why:
            left_out[why] = left_out.get(why, 0) + 1
            continue
        records.append({**{c: v for c, v in r.items() if c != "_question"},
                        "question": r["_question"], "answers": a,
                        "gold_scores": [round(float(v), 6) for v in g]})
    return records, left_out


def run(cfg: Config) -> dict:
    """Answer, grade, write -> a summary (counts and costs)."""
    p = check(cfg)
    rows = load_questions(p)
    if p.gold_reward is not None:
        check_rows([p.gold_reward], rows, "question", key="precompute.gold_reward")
    policy = open_client(p.answers, "precompute.answers", "precompute.answers")
    judge = open_client(cfg.judge, "judge", "judge") if p.gold_reward is None else None
    k = p.num_answers
    asks = [chat_messages(r["_question"], p.system_prompt) for r in rows]
    grades = k * sum(len(r[p.criteria_key]) for r in rows) if p.criteria_key else len(rows) * k
    print(f"[precompute] {len(rows)} questions x {k} answers from {policy.cfg.model}: "
          f"{len(rows) * k} answer requests ({policy.cached(asks, k)} of them cached, free)"
          + ("" if judge is None else f", then up to {grades} judge requests (cached ones free)"))
    answers, gold = answer_and_grade(cfg, policy, judge, rows, asks)
    records, left_out = kept_records(rows, answers, gold, p.keep_constant)
    if records:
        Path(p.out).parent.mkdir(parents=True, exist_ok=True)
        jsonl.write_records(p.out, records, default=str)
    cost = {"answers": policy.pop_step_stats()["judge_cost_usd_total"]}
    if judge is not None:
        cost["judge"] = judge.pop_step_stats()["judge_cost_usd_total"]
    golds = [v for rec in records for v in rec["gold_scores"]]
    return {"questions": len(rows), "written": len(records), "left_out": left_out, "cost_usd": cost,
            "mean_gold": sum(golds) / len(golds) if golds else None}


def validate(cfg: Config, path: str) -> dict:
    """The reward the expert rubrics earn on an answer file (module docstring)."""
    p = cfg.precompute
    if cfg.judge is None:
        raise ConfigError("--validate grades through the judge: section; add one")
    rows = [row for _, row in
            mapped_rows(load_raw(DataConfig(name=path), "--validate"), path, None)]
    for i, row in enumerate(rows):
        if missing := [c for c in (p.rubric_key, "answers", "gold_scores")
                       if row.get(c) in (None, "", [])]:
            raise DataError(f"{path} row {i} has no {missing[0]!r}: --validate needs an answer "
                            f"file with the expert rubric (precompute.rubric_key={p.rubric_key}), "
                            "answers and gold_scores")
        try:  # before any grade is paid for
            rubric_alignment.check_row(row)
        except ValueError as e:
            raise DataError(f"{path} row {i}: {e}") from None
    samples = [{**r, "question": build_prompt(r, p.question, i)} for i, r in enumerate(rows)]
    judge = open_client(cfg.judge, "judge", "judge")
    rho = rubric_alignment([r[p.rubric_key] for r in rows], samples, judge=judge,
                           template=p.template)
    scored = [v for v in rho if math.isfinite(v)]
    stats = judge.pop_step_stats()
    return {"rows": len(rows), "scored": len(scored),
            "mean_rho": sum(scored) / len(scored) if scored else None,
            "constant": int(stats["judge_constant_scores"]),
            "cost_usd": stats["judge_cost_usd_total"]}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m tools.precompute",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any config field: --section.key=value (the precompute: section's in config.py)")
    ap.add_argument("--config", required=True, help="the training YAML, with a precompute: section")
    ap.add_argument("--validate", metavar="ANSWER_FILE",
                    help="score the expert rubrics of an answer file instead")
    return ap.parse_known_args(argv)


def said_validated(path: str, v: dict) -> int:
    """validate's line -> 0, or 1 when no question could be scored."""
    print(f"[precompute] the expert rubrics of {path} earn a mean Spearman of "
          + ("-" if v["mean_rho"] is None else f"{v['mean_rho']:.3f}")
          + f" over {v['scored']} of {v['rows']} questions ({v['rows'] - v['scored']} with "
          f"a failed judge call, {v['constant']} with grades or gold that do not rank); "
          f"cost this run: ${v['cost_usd']:.4f}")
    return 0 if v["scored"] else 1


def said_written(cfg: Config, summary: dict) -> int:
    """run's lines: what was written, what was left out and how to retry the failed ones -> 0, or
    1 when nothing was written."""
    p = cfg.precompute
    cost = ", ".join(f"{k} ${v:.4f}" for k, v in summary["cost_usd"].items())
    if summary["written"]:
        print(f"[precompute] wrote {summary['written']} of {summary['questions']} questions to "
              f"{p.out} (mean gold score {summary['mean_gold']:.3f}); cost this run: {cost}")
    else:
        print(f"[precompute] no question was kept, so {p.out} was not written; cost this run: "
              f"{cost}", file=sys.stderr)
    for why, n in summary["left_out"].items():
        print(f"[precompute] left out {n} question(s) with {why}", file=sys.stderr)
    if any(w.startswith("a failed") for w in summary["left_out"]):
        where = ("the same command" if not summary["written"]
                 else "into a new precompute.out (this one is kept)")
        print(f"[precompute] to retry the failed ones, rerun {where}: what was paid for is cached "
              f"({p.answers.cache_path}" + ("" if p.gold_reward else f", {cfg.judge.cache_path}")
              + ")", file=sys.stderr)
    return 0 if summary["written"] else 1


@command.one_line(ConfigError, DataError, ValueError, KeyError, OSError, JudgeUnusable)
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if args.validate:
            return said_validated(args.validate, validate(cfg, args.validate))
        summary = run(cfg)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (one_line raises it as one)
        print(f"\ninterrupted ({command.interrupted(e)[0]}): every answer (and grade) received is "
              "cached (precompute.answers.cache_path, and judge.cache_path for gold by the judge); "
              "rerun the same command: it pays only for the rest", file=sys.stderr)
        return command.interrupted(e)[1]
    return said_written(cfg, summary)


if __name__ == "__main__":
    sys.exit(main())
