"""Two judges on the same completions: at once (compute_rewards's default) vs one after the other.

    .venv/bin/python bench/slow_judges/two_judges.py --judge-delay 2 --completions 16 --reps 3

One process, alternating, on the same work: --completions completions, a judge reward on each of two
local fake judges (tests/fake_openai_server.py, answering every request after --judge-delay
seconds, 8 requests at a time, no cache). "One after the other" is two compute_rewards calls, one
judge's reward each, which is what scoring did before the judges ran at once; "at once" is one call
with both. Reports the medians and at once / one after the other. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from api.client import JudgeConfig  # noqa: E402
from config import RewardSpec  # noqa: E402
from fake_openai_server import FakeOpenAIServer, length_score, ok  # noqa: E402
from judge import open_judges  # noqa: E402
from rewards import compute_rewards, reward_context  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--judge-delay", type=float, default=2.0,
                    help="seconds each fake judge takes per request")
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3,
                    help="alternations (one after the other, at once)")
    args = ap.parse_args()
    with FakeOpenAIServer(reply=length_score, default=ok(delay_s=args.judge_delay)) as a, \
            FakeOpenAIServer(reply=length_score, default=ok(delay_s=args.judge_delay)) as b:
        config = dict(api_key_env="MINIGRPO_BENCH_NO_KEY", max_concurrent=8, max_retries=0,
                      memory_cache=False)
        judges = open_judges(JudgeConfig(base_url=a.url, model="first", **config),
                             {"second": JudgeConfig(base_url=b.url, model="second", **config)})
        template = {"template": "Score 0-10 as JSON: {completion}"}
        first = RewardSpec("judge", label="first", args=template)
        second = RewardSpec("judge", label="second", args={"judge": "second", **template})
        context = reward_context("", judges)
        times: dict[str, list[float]] = {"one after the other": [], "at once": []}
        for rep in range(args.reps):
            # new texts each rep: no reply reused
            texts = [f"answer {rep}-{i}" for i in range(args.completions)]
            for way, calls in (("one after the other", [[first], [second]]),
                               ("at once", [[first, second]])):
                t0 = time.perf_counter()
                results = [compute_rewards(texts, [{}] * len(texts), specs, context=context)
                           for specs in calls]
                times[way].append(time.perf_counter() - t0)
                assert all(not any(r.errors.values()) for r in results), "a judge call failed"
                print(f"rep {rep} {way}: {times[way][-1]:.2f} s", file=sys.stderr, flush=True)
    seq, par = statistics.median(times["one after the other"]), statistics.median(times["at once"])
    print(f"two judges, {args.completions} completions, judge delay {args.judge_delay} s, "
          f"8 requests at a time each, {args.reps} reps")
    print(f"one after the other {seq:.2f} s, at once {par:.2f} s: {par / seq:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
