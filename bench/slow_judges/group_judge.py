"""Pointwise and group judging on the quickstart's sums, where answer_match knows the right order.

    .venv/bin/python bench/slow_judges/group_judge.py --steps 10  # a fake judge (0.5 s a reply)
    .venv/bin/python bench/slow_judges/group_judge.py --steps 10 \
        --judge-url http://127.0.0.1:8080/v1 --judge-model smollm2-135m \
        --constrain llama.cpp                                         # a real local judge

Trains configs/quickstart.yaml twice for --steps steps, the same seed, each time with an LLM judge
beside its rewards at weight 0 (scored and logged, not trained on: both runs sample the same
completions, so the judges are compared on the same groups): `judge` with a pointwise template,
then `group_judge` (one request a prompt, judge.py). Per mode it reports, as means over the steps:
the judge's HTTP requests (judge_sent) and tokens, the step's seconds (step_time) and those of its
sampling and scoring (rollout_time), and how often the judge orders a group as answer_match does:
Spearman's rho within each group whose answer_match values differ (a judge that scores such a
group flat counts 0; a group it failed is left out and counted). --constrain sends the grammar
(llama.cpp) or the structured outputs (vLLM) of docs/rewards-and-judges.md for each mode. Without
--judge-url a fake judge (tests/fake_openai_server.py) answers after --judge-delay seconds with
scores that follow the text's length, not its correctness: it measures the requests, tokens and
time, and its rho is noise. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import rewards  # noqa: E402
import train  # noqa: E402
from fake_openai_server import FakeOpenAIServer, ok, shaped_score  # noqa: E402

POINTWISE = ("You are judging an answer to a request.\n\nRequest:\n{prompt}\n\nAnswer:\n"
             "{completion}\n\nScore the answer from {score_min} to {score_max}.\n"
             "Reply with only: Score: <number>")
SCORE_MAX = 9  # one digit: what the grammars allow


def constraint(mode: str, server: str | None, g: int) -> dict:
    """docs/rewards-and-judges.md's extra_body for a small local judge of `mode`."""
    if server is None:
        return {}
    if mode == "judge":
        return ({"grammar": 'root ::= "Score: " [0-9]'} if server == "llama.cpp"
                else {"structured_outputs": {"regex": "Score: [0-9]"}})
    if server == "llama.cpp":
        return {"grammar": f'root ::= "{{\\"scores\\": [" [0-9] (", " [0-9]){{{g - 1}}} "]}}"'}
    items = {"type": "integer", "minimum": 0, "maximum": SCORE_MAX}
    return {"structured_outputs": {"json": {
        "type": "object", "required": ["scores"], "additionalProperties": False,
        "properties": {"scores": {"type": "array", "minItems": g, "maxItems": g,
                                  "items": items}}}}}


def run_mode(mode: str, args, url: str, out: Path) -> tuple[list[dict], list[tuple]]:
    """Train the quickstart with `mode`'s judge at weight 0 -> (metrics a step, (judge values,
    answer_match values) a group)."""
    g = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())["rollout"]["num_generations"]
    judge_args = {"template": POINTWISE, "criteria": []} if mode == "judge" else {}
    cfg = {"extends": str(ROOT / "configs/quickstart.yaml"),
           "judge": {"base_url": url, "model": args.judge_model, "api_key_env": "MINIGRPO_NO_KEY",
                     "max_concurrent": args.max_concurrent, "cache_path": None,
                     "score_max": SCORE_MAX, "max_tokens": 8 if mode == "judge" else 48,
                     "extra_body": constraint(mode, args.constrain, g)},
           "rewards": [{"name": "answer_match", "weight": 1.0},
                       {"name": "short_answer", "weight": 0.5, "args": {"max_words": 4}},
                       {"name": mode, "label": "judged", "weight": 0.0, "args": judge_args}],
           "run": {"out_dir": str(out / mode), "steps": args.steps, "save_every": 0,
                   "sample_every": 0, "threads": args.threads}}
    (out / f"{mode}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    groups, real = [], rewards.Rewards.__call__  # what the step's prepared rewards return

    def recorded(self, texts, samples, **kw):
        res = real(self, texts, samples, **kw)
        for a in range(0, len(texts), g):
            groups.append((res.per_reward["judged"][a:a + g],
                           res.per_reward["answer_match"][a:a + g]))
        return res
    rewards.Rewards.__call__ = recorded
    try:
        code = train.main(["--config", str(out / f"{mode}.yaml")])
    finally:
        rewards.Rewards.__call__ = real
    if code != 0:
        raise SystemExit(f"error: the {mode} run ended with exit code {code}")
    metrics = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
    return metrics, groups


def agreement(groups: list[tuple]) -> tuple[float, int, int]:
    """(mean rho over the groups whose answer_match values differ, those groups, those the judge
    failed on): rho = Spearman(judge, answer_match) within the group, 0 for a flat judge."""
    rhos, failed = [], 0
    for judged, truth in groups:
        if len(set(truth)) < 2:
            continue
        if any(v is None for v in judged):
            failed += 1
        elif len(set(judged)) < 2:
            rhos.append(0.0)
        else:
            rhos.append(float(spearmanr(judged, truth).statistic))
    return (statistics.mean(rhos) if rhos else math.nan), len(rhos) + failed, failed


def report(mode: str, metrics: list[dict], groups: list[tuple]) -> dict:
    def mean(key: str) -> float:
        return statistics.mean(m.get(key, 0.0) for m in metrics)
    rho, ranked, failed = agreement(groups)
    return {"mode": mode, "steps": len(metrics), "requests": mean("judge_sent"),
            "prompt_tokens": mean("judge_prompt_tokens"),
            "completion_tokens": mean("judge_completion_tokens"),
            "failures": mean("judge_failures"), "step_s": mean("step_time"),
            "rollout_s": mean("rollout_time"), "spearman": rho, "groups_ranked": ranked,
            "groups_failed": failed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--judge-url", help="a running OpenAI-compatible judge (default: a fake one)")
    ap.add_argument("--judge-model", default="fake-judge", help="the served model's name")
    ap.add_argument("--judge-delay", type=float, default=0.5,
                    help="seconds the fake judge takes a reply")
    ap.add_argument("--constrain", choices=["llama.cpp", "vllm"],
                    help="send the docs' grammar (llama.cpp) or structured outputs (vllm)")
    ap.add_argument("--max-concurrent", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="run.threads")
    ap.add_argument("--out-dir", help="where the two runs go (default: a temporary folder)")
    args = ap.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="group_judge_"))
    out.mkdir(parents=True, exist_ok=True)
    fake = None if args.judge_url else FakeOpenAIServer(
        reply=lambda body: shaped_score(body, SCORE_MAX), default=ok(delay_s=args.judge_delay))
    url = args.judge_url or fake.start().url
    try:
        rows = [report(mode, *run_mode(mode, args, url, out)) for mode in ("judge", "group_judge")]
    finally:
        if fake:
            fake.close()
    judge = args.judge_url and f"{args.judge_model} at {args.judge_url}" or \
        f"the fake judge ({args.judge_delay:g} s a reply)"
    print(f"quickstart, {args.steps} steps, judge: {judge}, constrained: {args.constrain or 'no'}")
    print(f"{'mode':12} {'requests':>8} {'prompt tok':>10} {'reply tok':>9} {'failed':>6} "
          f"{'step s':>7} {'rollout s':>9} {'spearman':>8} {'groups':>6}")
    for r in rows:
        print(f"{r['mode']:12} {r['requests']:8.1f} {r['prompt_tokens']:10.0f} "
              f"{r['completion_tokens']:9.0f} {r['failures']:6.1f} {r['step_s']:7.2f} "
              f"{r['rollout_s']:9.2f} {r['spearman']:8.3f} {r['groups_ranked']:4d}"
              + (f" ({r['groups_failed']} failed)" if r["groups_failed"] else ""))
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"(means a step; spearman: within groups answer_match ranks; {out / 'results.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
