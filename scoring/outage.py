"""A judge that fails part of the way: a step it mostly failed is not trained on; one that stops
answering mid-run is waited for, or the run checkpoints and stops (run.judge_outage); one whose
replies are mostly unusable stops the run.

    batch.minis = outage.minis_to_train(run, batch.minis, errors, scored)   # step.py's seam
    for judge in outage.down(judges, cfg.run.judge_outage_steps):  # down that many steps in a row
        back = outage.wait(judge, seconds=30 * 60)   # asked again with backoff until it answers
    for line in outage.unusable_summary(judges): ...  # the run's end: judges mostly unusable

A step in which more than run.judge_max_failed_share of a judge's calls got no reply is not
trained on: no optimizer update (the schedule advances, as for a skipped non-finite gradient),
counted in judge_steps_skipped. Its completions' rewards would be the few that got through, and a
failed call is no judgement (the rewards' default fallback is skip).

A step in which (nearly) every call a judge sent got no HTTP reply at all (client.OUTAGE_SHARE,
client.OUTAGE_MIN_CALLS) is a step down; a step answered from the cache alone says nothing.
Without this, a judge killed mid-run leaves every later call to its fallback: hours of GPU time
training on nothing. Before its first reply (in this run: a resumed run's checkpoint says whether
it answered before) a judge that never answers stops the run at once instead (client.FAILED_LIMIT:
the endpoint is wrong, not down).

A judge whose replies held no usable score more often than run.judge_max_unusable_share in
run.judge_unusable_steps steps in a row stops the run (JudgeUnusable, exit code 2) with one of its
replies and what to fix: the template, a grammar through extra_body, a larger judge.

A reward that failed on every completion of a step, for whatever reason (a request that could not
be built, a judge refusing each call, a bug), stops the run before the step is trained on
(check_rewards: RewardFailed, exit code 2), unless a judge that had answered got no reply at all:
the outage above.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Callable

from api.client import Judge
from config import JudgeUnusable
from parallel import distributed
from rewards import reward_keys

FIRST_PAUSE_S = 10.0  # the first wait before asking again; doubles up to MAX_PAUSE_S
MAX_PAUSE_S = 60.0  # so a line is said at least each minute
SUMMARY_SHARE = 0.1  # a judge unusable more often than this over the run gets a line at its end
sleep, clock = time.sleep, time.monotonic  # tests replace them


def down(judges: dict[str, Judge], steps: int) -> list[Judge]:
    """The judges down for `steps` steps in a row, on any of torchrun's ranks (the same list on
    every rank). One that has never answered is not down but wrong (client.FAILED_LIMIT stops the
    run with its first failures)."""
    return distributed.down_anywhere(
        [j for j in judges.values() if j.has_answered and j.down_steps >= steps], judges)


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


# --- a step a judge failed: not trained on, or the run stopped -----------------------------------
def minis_to_train(run, minis: list, errors: dict[str, int] | None = None,
                   scored: int = 0) -> list:
    """The step's mini-batches (step.Batch.minis), or none when a judge failed more than
    run.judge_max_failed_share of the step's calls: then no optimizer update is made (the schedule
    advances as if), judge_steps_skipped counts it and a line says so. JudgeUnusable when a judge's
    replies were unusable past run.judge_max_unusable_share for run.judge_unusable_steps steps, and
    RewardFailed when a reward failed on each of the `scored` completions (its `errors`: the step's
    reward_errors; check_rewards). The counts are summed over torchrun's ranks (all_sum), so every
    rank decides the same; under torchrun the step calls it on every rank at every step (a
    reward's failures differ by rank, and a rank that did not call would not join the sum)."""
    sums = distributed.all_sum
    per = step_calls(run.judges, sums)
    for name, judge in run.judges.items():
        check_unusable(judge, per[name], run.cfg.run)
    check_rewards(run, per, errors or {}, scored, sums)
    cap = run.cfg.run.judge_max_failed_share
    failed = [(j, per[n]) for n, j in run.judges.items()
              if per[n]["calls"] and per[n]["no_reply"] > cap * per[n]["calls"]]
    if not failed:
        return minis
    for judge, _ in failed:
        judge.add_stat("steps_skipped", 1.0 / run.world)  # summed over the ranks: 1
    said = "; ".join(f"{j.label} got no reply to {c['no_reply']:.0f} of {c['calls']:.0f} calls "
                     f"({j.masked(j.last_failure)})" for j, c in failed)
    say(f"step {run.step} is not trained on: {said}; more than run.judge_max_failed_share="
        f"{cap:g}, so its update is skipped (judge_steps_skipped)")
    skip_schedule(run.scheduler, len(minis) * run.cfg.grpo.num_iterations)
    return []


def step_calls(judges: dict[str, Judge], sums: Callable[[dict], dict]) -> dict[str, dict]:
    """Each judge's calls this step, those without a reply and those unusable (Judge.step_calls),
    summed over the ranks by `sums`."""
    flat = sums({f"{name}/{k}": v for name, j in judges.items() for k, v in j.step_calls().items()})
    return {name: {k: flat[f"{name}/{k}"] for k in ("calls", "no_reply", "unusable")}
            for name in judges}


def skip_schedule(scheduler, updates: int) -> None:
    """The learning-rate schedule moved on by `updates` not made: a resumed run rebuilds it from
    the steps done, so an uninterrupted run must agree with it."""
    with warnings.catch_warnings():  # torch warns of a scheduler step without an optimizer step
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        for _ in range(updates):
            scheduler.step()


class RewardFailed(JudgeUnusable):
    """A reward failed on every completion of a step (train.py stops as for JudgeUnusable)."""


def check_rewards(run, per: dict[str, dict], errors: dict[str, int], scored: int,
                  sums: Callable[[dict], dict]) -> None:
    """RewardFailed when a reward failed on every one of the step's `scored` completions (`errors`:
    reward name -> failures), for whatever reason (a URL no request can be built for, a reply
    refused, a bug): the step would train on nothing, and so would the next. Not while a judge
    that has answered before got no HTTP reply to (nearly) all it sent this step (Judge.unheard):
    that is an outage, which run.judge_outage waits for; nor for a reward of weight 0, which is
    logged, not trained on. `per`: each judge's step_calls."""
    silent = any(j.has_answered and j.unheard for j in run.judges.values())
    total = sums({"scored": scored, "silent": float(silent),
                  **{f"errors/{k}": v for k, v in errors.items()}})
    weights = dict(zip(reward_keys(run.cfg.rewards), (s.weight for s in run.cfg.rewards)))
    every = [k for k in errors
             if 0 < total["scored"] <= total[f"errors/{k}"] and weights.get(k, 1) != 0]
    if not every or total["silent"]:
        return
    said = [judge.masked(f"{judge.label}: " + (
        f"one reply was {judge.unusable_reply[:160]!r}" if c["unusable"]
        else judge.last_failure.removeprefix(f"{judge.label}: ")))
        for name, judge in run.judges.items() if (c := per[name])["calls"]
        and c["no_reply"] + c["unusable"] >= c["calls"]]
    raise RewardFailed(
        f"reward {every[0]!r} failed on all {total['scored']:.0f} completions of step {run.step} "
        f"(reward_errors/{every[0]}; its first failure is logged above"
        + "".join(f"; {s}" for s in said) + "): a step scored by nothing learns nothing")


def check_unusable(judge: Judge, counts: dict, cfg) -> None:
    """This step's share of unusable replies (no usable score) among those the judge got: over
    cfg.judge_max_unusable_share for cfg.judge_unusable_steps steps in a row raises JudgeUnusable
    with one of them and what to fix. A step without a reply says nothing of it."""
    replies = counts["calls"] - counts["no_reply"]
    if replies <= 0:
        return
    over = counts["unusable"] > cfg.judge_max_unusable_share * replies
    judge.unusable_steps = judge.unusable_steps + 1 if over else 0
    if judge.unusable_steps >= cfg.judge_unusable_steps:
        cap = cfg.judge_max_unusable_share
        raise JudgeUnusable(judge.masked(
            f"{judge.label}: {counts['unusable']:.0f} of {replies:.0f} replies held no usable "
            f"score this step, more than run.judge_max_unusable_share={cap:g} for "
            f"{judge.unusable_steps} steps in a row; one was {judge.unusable_reply[:160]!r}; "
            + garbage_fix(judge)))


def garbage_fix(judge: Judge) -> str:
    """What to change for a judge whose replies hold no usable score."""
    return (f"fix its template (ask for 'Score: <n>' and nothing else), constrain its replies "
            f"with a grammar through {judge.key}.extra_body (docs/rewards-and-judges.md, small "
            "local judges), or use a larger judge")


def unusable_summary(judges: dict[str, Judge]) -> list[str]:
    """A line for each judge whose replies held no usable score more than SUMMARY_SHARE of the time
    over the run (its run totals, across --resume)."""
    lines = []
    for judge in judges.values():
        t = judge.totals
        replies = t["calls"] - t["failures"] + t["unusable"]
        if replies and t["unusable"] > SUMMARY_SHARE * replies:
            lines.append(judge.masked(
                f"[minigrpo] warning: {judge.label}: {t['unusable']:.0f} of {replies:.0f} replies "
                f"({t['unusable'] / replies:.0%}) held no usable score over the run, each left to "
                "the reward's fallback (judge_unusable_total); "
                + (f"the last was {judge.unusable_reply[:160]!r}; " if judge.unusable_reply else "")
                + garbage_fix(judge)))
    return lines
