"""The metrics eval.py reports for one model (and train.py's eval/* with run.eval_every), and those
of a mixture's sources in a GRPO step (source_metrics), as plain functions of the rewards: no
model, no I/O (the step's own metrics are step.step_metrics).

Metrics, over the N completions (prompt-major, n = num_samples per prompt). ok_r(i): reward r of
completion i is not None and >= 1; correct(i) = ok_r(i) for r = choice_accuracy, else answer_match:
  accuracy           = #correct / #completions with a gold answer (r not None)
  valid_json_rate    = #ok_json_valid / N
  schema_pass_rate   = #ok_json_schema / N                       (n_schema_pass = the count)
  accuracy_on_schema = #(correct and ok_json_schema) / n_schema_pass; 0.0 when n_schema_pass = 0
                       (no usable answer is no correct usable one; n_schema_pass tells them apart)
  pass@k             = mean over prompts of 1 - C(n-c, k) / C(n, k), c = correct samples of the
                       prompt (the unbiased estimator of Chen et al. 2021); only when n > 1
  reward             = mean weighted total (over the completions not skipped: a reward with
                       fallback: skip that failed leaves its completion out, counted in `skipped`);
                       reward/<name> = mean of the non-None values, as in training (judge rewards
                       report their judge scores here); reward_errors/<name> = completions whose
                       reward raised and got its fallback (listed when > 0)
  best_of_n_reward   = mean over prompts of the highest total among a prompt's n samples: best-of-n
                       sampling with the reward as the picker (only when n > 1)
  maj@n              = mean over prompts of whether the answer most of its n samples give is right
                       (self-consistency; answer_match's answers; majority_accuracy; only if n > 1)
  mean_length        = mean completion tokens, up to and including the first EOS
  truncated_rate     = share of completions that hit max_new_tokens without EOS (API models: cut at
                       their section's max_tokens, finish_reason "length")
  api_failures, api_cost_usd (the n above leaves failed API requests out); judge_failures,
                       judge_cost_usd (judges/<name>/failures, /cost_usd for the judges: section's):
                       from the Judge clients' counters
  agreement/<a>_vs_<b>/spearman, /mean_abs_diff, /n: for each eval.agreement pair of rewards (one
                       criterion from two judges), over the completions both scored (`agreement`)
With a mixture, <source>/n, <source>/reward and <source>/accuracy give each source's share.
Each task metric appears only when the reward it derives from is configured.
"""
from __future__ import annotations

import math

from scipy.stats import spearmanr

from rewards import RewardResult, reward_means


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: the chance that k of the n samples, drawn without replacement, hold one of
    the c correct.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 3), pass_at_k(4, 3, 2)
    (0.25, 0.5, 0.0, 1.0)
    """
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def task_metrics(per_reward: dict[str, list[float | None]], num_samples: int = 1,
                 pass_k: list[int] = ()) -> dict:
    """accuracy, valid_json_rate, schema_pass_rate, accuracy_on_schema, pass@k (module docstring).

    >>> task_metrics({"answer_match": [1.0, 0.0, 1.0, 1.0]}, num_samples=2, pass_k=[1, 2])
    {'accuracy': 0.75, 'pass@1': 0.75, 'pass@2': 1.0}
    """
    ok = {k: [v is not None and v >= 1 for v in vs] for k, vs in per_reward.items()}
    out: dict = {}
    key = next((k for k in ("choice_accuracy", "answer_match") if k in per_reward), None)
    if key:
        graded = [i for i, v in enumerate(per_reward[key]) if v is not None]
        out["accuracy"] = sum(ok[key][i] for i in graded) / max(len(graded), 1)
    if "json_valid" in ok:
        out["valid_json_rate"] = sum(ok["json_valid"]) / len(ok["json_valid"])
    if "json_schema" in ok:
        out |= _schema_metrics(ok["json_schema"], ok[key] if key else None)
    if key and num_samples > 1:
        out |= _pass_at_k_metrics(per_reward[key], ok[key], num_samples, pass_k)
    return out


def _schema_metrics(schema_ok: list[bool], correct: list[bool] | None) -> dict:
    """schema_pass_rate, n_schema_pass and (with a correctness reward) accuracy_on_schema."""
    out: dict = {}
    passed = [i for i, p in enumerate(schema_ok) if p]
    out["schema_pass_rate"] = len(passed) / len(schema_ok)
    if correct is not None:
        out["accuracy_on_schema"] = (sum(correct[i] for i in passed) / len(passed)
                                     if passed else 0.0)
    out["n_schema_pass"] = len(passed)
    return out


def _pass_at_k_metrics(values: list[float | None], correct: list[bool], num_samples: int,
                       pass_k: list[int]) -> dict:
    """pass@k for each k, over the prompts whose num_samples completions all have a gold answer."""
    groups = [range(s, s + num_samples) for s in range(0, len(values), num_samples)]
    groups = [g for g in groups if all(values[i] is not None for i in g)]  # with a gold answer
    return {f"pass@{k}": sum(pass_at_k(num_samples, sum(correct[i] for i in g), k)
                             for g in groups) / max(len(groups), 1) for k in pass_k}


def best_of_n(totals: list[float], n: int) -> float:
    """Mean over prompts of the best total among the prompt's n samples (skipped ones left out):
    what best-of-n sampling with this reward as the picker would score.

    >>> best_of_n([0.0, 1.0, 0.5, 0.5, float("nan"), 0.0], 3)
    0.75
    """
    best = [max(ok) for s in range(0, len(totals), n)
            if (ok := [t for t in totals[s:s + n] if not math.isnan(t)])]
    return sum(best) / max(len(best), 1)


def majority_accuracy(answers: list, correct: list[float | None], n: int) -> float:
    """maj@n: for each prompt with a gold answer, is the answer most of its n samples give right?
    Samples without an answer (None) do not vote; a tie goes to the answer given first; a prompt
    none of whose samples answered counts as wrong. answers, correct: (N,), prompt-major.

    >>> majority_accuracy(["3", "4", "4", None, "7", "7", None, None, None],
    ...                   [0, 1, 1, 0, 0, 0, 0, 0, 0], 3)
    0.3333333333333333
    """
    right, prompts = 0, 0
    for s in range(0, len(answers), n):
        if any(c is None for c in correct[s:s + n]):
            continue  # no gold answer
        prompts += 1
        votes: dict = {}
        for a, c in zip(answers[s:s + n], correct[s:s + n]):
            if a is not None:
                votes.setdefault(a, [0, c])[0] += 1
        if votes:
            right += max(votes.values(), key=lambda v: v[0])[1] >= 1  # max keeps the first of a tie
    return right / max(prompts, 1)


def agreement(a: list[float | None], b: list[float | None]) -> dict:
    """How two rewards (one criterion from two judges, say) agree over the completions both scored:
    spearman = Spearman's rho of the two lists (None when either is constant or fewer than 2 pairs),
    mean_abs_diff = mean |a_i - b_i|, n = the completions both scored.

    >>> agreement([1.0, 2.0, 3.0, None], [3.0, 5.0, 4.0, 0.0])
    {'spearman': 0.5, 'mean_abs_diff': 2.0, 'n': 3}
    """
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    ranked = len(set(xs)) > 1 and len(set(ys)) > 1  # a constant list has no ranking
    return {"spearman": float(spearmanr(xs, ys).statistic) if ranked else None,
            "mean_abs_diff": sum(abs(x - y) for x, y in pairs) / len(pairs) if pairs else None,
            "n": len(pairs)}


def model_metrics(res: RewardResult, num_tokens: list[int], truncated: list[bool] | None,
                  num_samples: int, pass_k: list[int], agree: list[list[str]] = ()) -> dict:
    """Everything reported for one model: counts, task metrics, reward means and errors, lengths
    (num_tokens, truncated: per completion; truncated None when unknown, for API models)."""
    n = len(num_tokens)
    scored = [t for t in res.total if not math.isnan(t)]  # NaN: skipped (a reward's fallback: skip)
    out = {"n": n, **task_metrics(res.per_reward, num_samples, pass_k),
           **({"reward": sum(scored) / len(scored)} if scored else {})}
    if len(scored) < n:
        out["skipped"] = n - len(scored)
    if num_samples > 1:
        out["best_of_n_reward"] = best_of_n(res.total, num_samples)
    out |= {f"reward/{k}": v for k, v in reward_means(res.per_reward).items()}
    out |= {f"reward_errors/{k}": v for k, v in res.errors.items() if v}
    for a, b in agree:
        out |= {f"agreement/{a}_vs_{b}/{k}": v
                for k, v in agreement(res.per_reward[a], res.per_reward[b]).items()}
    out["mean_length"] = sum(num_tokens) / n
    if truncated is not None:
        out["truncated_rate"] = sum(truncated) / n
    return out


def failed_prompts(failed: list[bool] | None, n: int) -> set[int]:
    """The prompts (of n samples each) with a failed API request, left out of the metrics whole.

    >>> sorted(failed_prompts([False, True, False, False, True, True], 2)), failed_prompts(None, 2)
    ([0, 2], set())
    """
    return {i // n for i, f in enumerate(failed or []) if f}


def per_source_metrics(where: list[dict], n: int, res: RewardResult,
                       failed: list[bool] | None = None, key: str = "source") -> dict:
    """<source>/n, /reward and /accuracy for each source of a mixture (GRubrics: open/verifiable),
    or each label under `key` (eval.group_by's "<column>=<value>"), over the answered prompts (a
    prompt with a failed API request left out whole, as in the totals)."""
    out = {}
    left_out = failed_prompts(failed, n)
    for label in dict.fromkeys(w[key] for w in where):
        idx = [i for i in range(len(res.total))
               if where[i // n][key] == label and i // n not in left_out]
        out[f"{label}/n"] = len(idx)
        if not idx:
            continue
        scored = [res.total[i] for i in idx if not math.isnan(res.total[i])]
        if scored:
            out[f"{label}/reward"] = sum(scored) / len(scored)
        task = task_metrics({k: [v[i] for i in idx] for k, v in res.per_reward.items()})
        if "accuracy" in task:
            out[f"{label}/accuracy"] = task["accuracy"]
    return out


def source_shares(r) -> dict:
    """For a mixture: data/<label>, the share of rows drawn since the last call (this step's) from
    each source, and data/<label>/weight, the share the mixture (its curriculum, now) draws with."""
    counts = r.sampler.pop_counts()
    if len(counts) < 2:
        return {}
    return ({f"data/{label}": n / max(1, sum(counts)) for label, n in zip(r.source_labels, counts)}
            | {f"data/{label}/weight": w for label, w in zip(r.source_labels, r.sampler.shares())})


def source_metrics(r, drawn) -> dict:
    """For a mixture: data/<label> (source_shares), and data/<label>/reward, the mean reward of each
    source's completions (skipped ones left out)."""
    out = source_shares(r)
    if not out:
        return {}
    label_of, start = {}, 0  # a sample is one of r.rows itself: its source by identity
    for label, size in zip(r.source_labels, r.sampler.sizes):
        label_of.update((id(row), label) for row in r.rows[start:start + size])
        start += size
    rewards: dict[str, list[float]] = {}
    for sample, total in zip(drawn.samples, drawn.total.tolist()):
        if not math.isnan(total) and id(sample) in label_of:
            rewards.setdefault(label_of[id(sample)], []).append(total)
    return out | {f"data/{label}/reward": sum(v) / len(v) for label, v in rewards.items()}
