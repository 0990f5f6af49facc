"""How many seeds a difference needs, before the GPU time is spent: `python -m tools.ablate --plan`.

From a pilot (two arms x 2-3 seeds, tools/ablate.py), each metric's paired differences d_s = arm -
baseline give their spread sd. The report's test is the paired t-test (scipy.stats.ttest_rel,
two-sided, 95%); for n seeds and a true difference delta its power is, exactly for normal d,

    power(n) = P(|T| > t_{0.975, n-1}),   T ~ noncentral t(df = n - 1, nc = delta sqrt(n) / sd)

and the seeds needed are the smallest n with power(n) >= 0.8. delta is the difference one hopes to
detect (--plan METRIC=DELTA), by default what the pilot measured. With 2-3 pilot seeds sd is itself
uncertain: the seeds needed at its one-sided 80% upper bound, sd sqrt((k - 1) / chi2_{0.2, k-1}) for
k pilot seeds, are given beside. The time is the pilot's pace: its runs' mean wall time (train and
eval, as ablate.json recorded them), the runs going `jobs` at a time as the pilot's did.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

POWER = 0.8
ALPHA = 0.05  # two-sided, the report's 95% intervals
MOST_SEEDS = 10_000  # past this a difference is out of reach: no answer


def power(n: int, delta: float, sd: float, alpha: float = ALPHA) -> float:
    """The paired t-test's power at n seeds for a true mean difference delta, differences of
    spread sd (the formula above; scipy's noncentral t).

    >>> round(power(10, 1.0, 1.0), 3)  # Cohen's d_z = 1 at 10 pairs: the textbook 0.80
    0.803
    """
    if n < 2:
        return 0.0
    if sd == 0:
        return 1.0 if delta else alpha
    df, nc = n - 1, abs(delta) * math.sqrt(n) / sd
    t = stats.t.ppf(1 - alpha / 2, df)
    # the far tail as the upper tail of -nc: scipy's nct.cdf(-t) is nan for a large nc
    return float(stats.nct.sf(t, df, nc) + stats.nct.sf(t, df, -nc))


def seeds_needed(delta: float, sd: float, target: float = POWER) -> int | None:
    """The smallest n (>= 2) with power(n) >= target; None past MOST_SEEDS (delta 0, or tiny
    against sd) or without a spread to go by (sd 0). Bisection: power grows with n.

    >>> seeds_needed(0.5, 1.0), seeds_needed(0.8, 1.0), seeds_needed(1.0, 1.0)
    (34, 15, 10)
    """
    if sd == 0 or power(MOST_SEEDS, delta, sd) < target:  # sd 0: a pilot too small to tell
        return None
    lo, hi = 2, MOST_SEEDS
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power(mid, delta, sd) < target else (lo, mid)
    return lo


def sd_upper(sd: float, k: int, level: float = 0.8) -> float:
    """The one-sided `level` upper confidence bound of a standard deviation estimated from k
    values: sd sqrt((k - 1) / chi2.ppf(1 - level, k - 1))."""
    return sd * math.sqrt((k - 1) / stats.chi2.ppf(1 - level, k - 1))


def plan(paired: list[dict], effects: dict[str, float], run_seconds: float, arms: int,
         jobs: int) -> list[dict]:
    """One row per paired metric (or those named in effects): the difference planned for, the
    pilot's spread, the seeds needed (and at the spread's upper bound), and the hours they take.
    paired: ablate_report.summarize's differences, each with the per-seed `values`."""
    rows = []
    for d in paired:
        if effects and d["metric"] not in effects or len(d["values"]) < 2:
            continue
        delta = abs(effects.get(d["metric"], d["mean"]))
        sd = float(np.std(d["values"], ddof=1))
        n, n_up = seeds_needed(delta, sd), seeds_needed(delta, sd_upper(sd, len(d["values"])))
        rows.append({"arm": d["arm"], "baseline": d["baseline"], "metric": d["metric"],
                     "delta": delta, "sd": sd, "pilot_seeds": len(d["values"]),
                     "power_now": power(len(d["values"]), delta, sd), "seeds": n,
                     "seeds_upper": n_up, "hours": hours(n, run_seconds, arms, jobs),
                     "hours_upper": hours(n_up, run_seconds, arms, jobs)})
    return rows


def hours(n: int | None, run_seconds: float, arms: int, jobs: int) -> float | None:
    """Wall hours for n seeds of every arm, `jobs` runs at a time, each run as long as the
    pilot's mean; None without an answer or a measured pace."""
    if n is None or not run_seconds:
        return None
    return math.ceil(n * arms / max(jobs, 1)) * run_seconds / 3600


def lines(rows: list[dict], label) -> list[str]:
    """The plan in sentences, one per row; `label` names a metric (ablate_report.label)."""
    out = []
    for r in rows:
        what = (f"{r['arm']} - {r['baseline']} on {label(r['metric'])}: to detect "
                f"{r['delta']:.3g} at {POWER:.0%} power (paired t, sd of the differences "
                f"{r['sd']:.3g} over {r['pilot_seeds']} pilot seeds, power now "
                f"{r['power_now']:.0%}): ")
        if r["sd"] == 0:
            out.append(what + "no estimate: the pilot's differences do not vary; run more seeds")
            continue
        if r["seeds"] is None:
            out.append(what + f"more than {MOST_SEEDS} seeds (no answer)")
            continue
        time = "" if r["hours"] is None else f", about {r['hours']:.1f} h"
        upper = (f"more than {MOST_SEEDS}" if r["seeds_upper"] is None else
                 f"{r['seeds_upper']}" + ("" if r["hours_upper"] is None
                                          else f" ({r['hours_upper']:.1f} h)"))
        out.append(what + f"{r['seeds']} seeds{time} at the pilot's pace; {upper} if the spread "
                   "is at its 80% upper bound")
    return out
