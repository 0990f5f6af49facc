"""A judge that stops answering mid-run (run.judge_outage): wait for it, or checkpoint and stop.

    for judge in outage.down(judges, cfg.run.judge_outage_steps):  # down that many steps in a row
        back = outage.wait(judge, seconds=30 * 60)   # asked again with backoff until it answers

A step in which (nearly) every call a judge sent got no HTTP reply at all (client.OUTAGE_SHARE,
client.OUTAGE_MIN_CALLS) is a step down; a step answered from the cache alone says nothing.
Without this, a judge killed mid-run leaves every later call to its fallback: hours of GPU time
training on zeros (`fallback: 0.0`) or on nothing (`fallback: skip`). Before its first reply a
judge that never answers stops the run at once instead (client.FAILED_LIMIT: the endpoint is
wrong, not down). The step that finds the outage has already trained on its fallbacks: with
fallback: skip it trained on nothing.
"""

from __future__ import annotations

import math
import sys
import time

from api.client import Judge

FIRST_PAUSE_S = 10.0  # the first wait before asking again; doubles up to MAX_PAUSE_S
MAX_PAUSE_S = 60.0  # so a line is said at least each minute
sleep, clock = time.sleep, time.monotonic  # tests replace them


def down(judges: dict[str, Judge], steps: int) -> list[Judge]:
    """The judges down for `steps` steps in a row. One that has never answered is not down but
    wrong (client.FAILED_LIMIT stops the run with its first failures)."""
    return [j for j in judges.values() if j.has_answered and j.down_steps >= steps]


def say(text: str) -> None:
    print(f"[minigrpo] {text}", file=sys.stderr, flush=True)


def wait(judge: Judge, seconds: float) -> bool:
    """Ask `judge` again (its last failed request, once: Judge.probe) after pauses of 10, 20, 40,
    60, 60 ... s, until it answers (True) or `seconds` have passed (False; math.inf: no limit). A
    line on stderr when the wait starts, after each try, and when the judge is back."""
    start, pause = clock(), FIRST_PAUSE_S
    limit = f"up to {seconds / 60:.1f} min" if math.isfinite(seconds) else "without limit"
    say(f"{what(judge)}; waiting for it, {limit} (run.judge_wait_minutes; run.judge_outage: "
        "stop stops instead)")
    while True:
        left = seconds - (clock() - start)
        if left <= 0:
            return False
        sleep(min(pause, left))
        if judge.probe(timeout_s=max(seconds - (clock() - start), 1.0)):
            judge.down_steps = 0
            say(f"{judge.label} answers again after {(clock() - start) / 60:.1f} min; going on")
            return True
        say(f"{judge.label} still down after {(clock() - start) / 60:.1f} min "
            f"({judge.masked(judge.last_failure)})")
        pause = min(2 * pause, MAX_PAUSE_S)


def what(judge: Judge) -> str:
    """The outage in words: the judge, how long, its last error."""
    return (f"{judge.label} got no reply to its calls for {judge.down_steps} step(s) in a row "
            f"(the last: {judge.masked(judge.last_failure)})")


def stop_line(judge: Judge, step: int, run_dir, resume: str) -> str:
    """The line a run stopped by an outage ends with: the judge, its last error, how to go on."""
    return (f"error: {what(judge)}; checkpoint saved at step {step} in {run_dir}; once it "
            f"answers, go on with: {resume}")
