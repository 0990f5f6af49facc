r"""Rewards: plain functions in a registry, run over completions (scoring/checks.py) with weights.

A reward scores one completion of one sample; None means "does not apply to this sample":

    def my_reward(completion: str, sample: dict, **args) -> float | None

A batched reward (LLM judges, see judge.py; people's ratings, graders/ratings.py) takes and returns
lists and is registered with `@register("name", batched=True)`. A reward may carry a
`check_args(**args)` attribute that raises ValueError on bad values: checks.check_specs calls it
before any model loads; an `open(**args)` attribute that acquires what it needs (reward_model loads
its model) when train.py or eval.py open their rewards, ValueError when it cannot; and a `row_keys`
attribute (or `register(..., row_keys=...)`) naming its arguments that hold a data column, as the
built-ins' gold_key and valid_key do: a column no row has stops the run before it starts
(check_rows). The config names rewards, weights and arguments:

    rewards:
      - {name: json_valid}
      - {name: choice_accuracy, weight: 2.0, args: {gold_key: cop}}
      - {name: my_rewards.py:no_hedging, weight: 0.5}      # a function in a file
      - {name: mypkg.rewards:brevity}                       # a function in an importable module

    total_i = sum_k weight_k * r_k(completion_i, sample_i)    (a None r_k adds 0)

Parameters after (completion, sample) named `num_tokens` (the completion's token count),
`assistant_prefix` (the text the trainer forced at the start of the reply, which the built-ins put
back in front), `judge` or `judges` are filled in by rewards.compute_rewards; a function named by
file or module is loaded by sources/plugins.py, which also runs reward functions written for
TRL's GRPOTrainer. Model output is only ever parsed (here, answers.py,
graders/citations.py), never evaluated.
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib
import inspect
import logging
import math
import numbers
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

import torch

import answers
import grpo
from config import ConfigError, JudgeUnusable, RewardSpec
from sources.plugins import (
    did_you_mean,
    import_function,
    is_trl_reward,
    one_line,
    trl_reward,
)

REGISTRY: dict[str, tuple[Callable, bool]] = {}  # name -> (function, batched)
def register(name: str, batched: bool = False, row_keys: tuple[str, ...] = ()):
    """Decorator that makes a reward available to configs under `name`; row_keys: its arguments that
    name a data column (check_rows checks the rows have it)."""
    def decorate(fn):
        if row_keys:
            fn.row_keys = row_keys
        old = REGISTRY.get(name)
        # the same module imported twice (doctest and tests) re-registers the same function: fine
        if old and (old[0].__module__, old[0].__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"reward {name!r} is already registered by "
                             f"{old[0].__module__}.{old[0].__qualname__}")
        REGISTRY[name] = (fn, batched)
        return fn
    return decorate


# ---------------------------------------------------------------- built-in rewards


@register("answer_match", row_keys=("gold_key",))
def answer_match(completion: str, sample: dict, gold_key: str = "answer", mode: str = "last",
                 tolerance: float = 1e-6, strip_think: bool = True, assistant_prefix: str = "",
                 compare: str = "number") -> float | None:
    r"""1.0 if the completion's final number equals the gold number, else 0.0; None without gold.

    The number is taken, in priority order, from `#### n`, `\boxed{n}`, `<answer>n</answer>`, else
    the last (mode="last") or first (mode="first") number of the answer; with strip_think the think
    block is ignored and an unclosed one leaves no answer. assistant_prefix (the forced
    data.assistant_prefix, passed in by the trainer, e.g. "<think>") is put back in front first.
    Accepted: 1,000 and 1{,}000, $5, 72., 3.0, -4, 3/4 and \frac{3}{4}; not 1e5 or 1 000. The gold
    sample[gold_key] is a number or a string read the same way (a GSM8K solution ending in
    `#### 72`). Numbers are compared exactly as fractions, within an absolute tolerance, so huge
    integers that are equal as floats still differ. A gold that is an expression (MATH's x^2+1,
    2\sqrt{2}, (-\infty,2]) raises ValueError rather than being read as its first number: with
    compare="expression" the completion's marked answer (\boxed{...}, `####`, <answer>; else the
    whole answer) and the gold's are compared as normalised text (answers.normalised), or as numbers
    when both are one. That is string equality, not algebra: x+1 and 1+x differ.

    >>> answer_match("48/2 = 24, 48 + 24 = 72.\n#### 72", {"answer": "She sold 48/2 = 24\n#### 72"})
    1.0
    >>> (answer_match(r"So \boxed{\frac{1}{2}}", {"answer": 0.5}),
    ...  answer_match("It costs $1,000.", {"answer": 1000}))
    (1.0, 1.0)
    >>> (answer_match("72 apples, minus 2, leaves 70", {"answer": 72}),
    ...  answer_match("72 apples, minus 2", {"answer": 72}, mode="first"))
    (0.0, 1.0)
    >>> (answer_match("so 70 + 2 = 72", {"answer": 72}),
    ...  answer_match("so 70 + 2 = 72", {"answer": 72}, assistant_prefix="<think>"))
    (1.0, 0.0)
    >>> (answer_match(r"\boxed{x^{2} + 1}", {"answer": "x^2+1"}, compare="expression"),
    ...  answer_match(r"\boxed{2}", {"answer": r"2\sqrt{2}"}, compare="expression"))
    (1.0, 0.0)
    """
    if compare not in ("number", "expression"):
        raise ValueError(f"compare must be 'number' or 'expression', not {compare!r}")
    gold = sample.get(gold_key)
    if gold is None:
        return None
    if isinstance(gold, bool) or not isinstance(gold, (int, float, str)):
        raise TypeError(f"gold answer {gold!r} is not a number or a string")
    completion = assistant_prefix + completion
    answer = answers.answer_part(completion) if strip_think else completion
    if compare == "expression":
        gold_text = str(gold) if not isinstance(gold, str) else (answers.marked(gold) or gold)
        pred = answers.marked(answer)
        return float(bool(answer)
                     and answers.same_expression(answer if pred is None else pred, gold_text))
    if isinstance(gold, str) and (expression := answers.expression_gold(gold)) is not None:
        raise ValueError(f"gold answer {expression!r} is an expression, not a number: answer_match "
                         "would compare its first number; set args: {compare: expression} to "
                         "compare answers as text")
    target = answers.final_number(gold) if isinstance(gold, str) else Fraction(gold)
    if target is None:
        raise ValueError(f"gold answer {gold!r} holds no number")
    pred = answers.final_number(answer, mode)
    return float(pred is not None and abs(pred - target) <= tolerance)


def answer_key(completion: str, assistant_prefix: str = "", mode: str = "last",
               strip_think: bool = True, compare: str = "number", **_) -> str | None:
    r"""The answer answer_match reads in a completion, as a majority-vote key (eval.py's maj@n):
    the exact number, or the normalised expression; None without one. Takes answer_match's args.

    >>> (answer_key("so 1,000"), answer_key(r"\boxed{\frac{1}{2}}"),
    ...  answer_key(r"\boxed{x^{2}}", compare="expression"), answer_key("none"))
    ('1000', '1/2', 'x^2', None)
    >>> (answer_key(r"\boxed{x = 5}", compare="expression")
    ...  == answer_key(r"\boxed{5}", compare="expression"))
    True
    """
    completion = assistant_prefix + completion
    answer = answers.answer_part(completion) if strip_think else completion
    if compare == "expression":
        return answers.expression_key(answers.marked(answer) or answer) or None
    number = answers.final_number(answer, mode)
    return None if number is None else str(number)


@register("think_format")
def think_format(completion: str, sample: dict, min_think_chars: int = 10,
                 require_answer: bool = True, assistant_prefix: str = "") -> float:
    r"""1.0 for exactly one leading <think>...</think> block then an answer, else 0.0.

    The block must open the text (after whitespace), hold at least min_think_chars characters
    besides whitespace, and be the only <think> and </think> (nested, repeated or unclosed
    blocks fail); with require_answer, non-blank text must follow it. assistant_prefix is what the
    trainer forced into the assistant turn (data.assistant_prefix, e.g. "<think>", passed in by
    the trainer): it belongs to the prompt, not the completion, so it is put back in front.

    >>> think_format("<think>48/2 = 24 clips</think>72", {}), think_format("<think></think>72", {})
    (1.0, 0.0)
    >>> (think_format("48/2 = 24 clips</think>72", {}),
    ...  think_format("48/2 = 24 clips</think>72", {}, assistant_prefix="<think>"))
    (0.0, 1.0)
    """
    text = (assistant_prefix + completion).lstrip()
    if not text.startswith("<think>") or text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    thought, _, answer = text[len("<think>"):].partition("</think>")
    return float(len(thought.strip()) >= min_think_chars
                 and (bool(answer.strip()) or not require_answer))


# "PMID: 111", and a list after one label on one line: "PMIDs: 12345, 67890 and 13579", "[PMID
# 12345; 67890]". Listed ids after the first have 5+ digits, as PMIDs cited today do, so a year, a
# dose or "30-day" after a citation ("PMID: 12345, 2019", "PMID: 12345, 2.5 mg") is not read as one.
@register("length_penalty")
def length_penalty(completion: str, sample: dict, num_tokens: int, max_tokens: int = 512,
                   cache_tokens: int = 128) -> float:
    r"""DAPO's soft overlong punishment (arXiv 2503.14476, "Overlong Reward Shaping") of the
    completion's token count L, which compute_rewards passes as num_tokens:

      0                                               if L <= max_tokens - cache_tokens
      (max_tokens - cache_tokens - L) / cache_tokens  if max_tokens - cache_tokens < L <= max_tokens
      -1                                              if L > max_tokens

    Set max_tokens to the generation limit: the penalty ramps 0 -> -1 over its last cache_tokens.

    >>> [length_penalty("", {}, n) for n in (384, 448, 512, 600)]
    [0.0, -0.5, -1.0, -1.0]
    """
    if not 0 <= cache_tokens <= max_tokens:
        raise ValueError("need 0 <= cache_tokens <= max_tokens, "
                         f"got {cache_tokens} and {max_tokens}")
    if num_tokens <= max_tokens - cache_tokens:
        return 0.0
    if num_tokens <= max_tokens:
        return (max_tokens - cache_tokens - num_tokens) / cache_tokens
    return -1.0


@register("short_answer")
def short_answer(completion: str, sample: dict, max_words: int = 8, strip_think: bool = True,
                 assistant_prefix: str = "") -> float:
    r"""Brevity in [0, 1] from the answer's word count n (whitespace-separated), m = max_words:

        1 if 1 <= n <= m;   (4m - n) / (3m) if m < n < 4m;   0 if n >= 4m or n == 0

    An empty answer scores 0, so that saying nothing is not the way to be brief. With
    strip_think the think block is not counted (an unclosed one leaves an empty answer).

    >>> short_answer("72", {}), short_answer(" ".join(["word"] * 20), {}), short_answer("", {})
    (1.0, 0.5, 0.0)
    """
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    completion = assistant_prefix + completion
    n = len((answers.answer_part(completion) if strip_think else completion).split())
    if n == 0 or n >= 4 * max_words:
        return 0.0
    return 1.0 if n <= max_words else (4 * max_words - n) / (3 * max_words)


# ---------------------------------------------------------------- every reward over a batch

log = logging.getLogger("minigrpo.scoring")
_LOGGED: set[str] = set()  # rewards whose first failure was logged: one traceback, not thousands
PER_COMPLETION = ("num_tokens", "episode")  # what compute_rewards fills, one value a completion


@dataclass
class RewardResult:
    total: list[float]  # (N,) weighted sum; a None component adds 0; NaN: skipped (fallback: skip)
    per_reward: dict[str, list[float | None]]  # (N,) raw values per reward; keys: reward_keys
    errors: dict[str, int]  # per reward: completions it failed to score (a batched call that
    #   raises: each of its completions)


def compute_rewards(completions: list[str], samples: list[dict], specs: list[RewardSpec], *,
                    num_tokens: list[int] | None = None,
                    context: dict | None = None) -> RewardResult:
    """Score N completions with every reward, prepared for this one call (a run prepares its
    rewards once: prepare_rewards); per-sample failures become the spec's fallback."""
    given = ["num_tokens"] if num_tokens is not None else []
    return prepare_rewards(specs, context or {}, given)(completions, samples,
                                                        num_tokens=num_tokens)


@dataclass
class Rewards:
    """A run's rewards resolved once (prepare_rewards): each spec's function, its keyword arguments
    (args, and the context it asks for) and the per-completion values it takes.

        score = prepare_rewards(cfg.rewards, context, given=("num_tokens",))   # at setup
        res = score(texts, samples, num_tokens=lengths)                        # each step

    res.total_i = sum_k weight_k * r_k(completion_i, sample_i)   (weighted_sum)
    Rewards calling different judges run at the same time (each judge's in config order, so its
    cache answers its later entries): a second judge does not wait for the first."""
    specs: list[RewardSpec]
    keys: list[str]  # reward_keys(specs)
    calls: list[tuple[Callable, bool, dict, list[str]]]  # _prepare's, one a spec
    lanes: list[list[int]] | None  # the specs by judge, run at the same time; None: in order

    def __call__(self, completions: list[str], samples: list[dict], *,
                 num_tokens: list[int] | None = None, episodes: list | None = None) -> RewardResult:
        n = len(completions)
        if len(samples) != n or (num_tokens is not None and len(num_tokens) != n):
            raise ValueError(f"got {n} completions, {len(samples)} samples and "
                             f"{'no' if num_tokens is None else len(num_tokens)} num_tokens; "
                             "they must match")
        have, errors = {"num_tokens": num_tokens, "episode": episodes}, dict.fromkeys(self.keys, 0)
        if self.lanes:  # judges at the same time: scoring/checks.py's lanes
            values = by_judge(self, completions, samples, have, errors)
        else:
            values = [reward_values(self, k, completions, samples, have, errors)
                      for k in range(len(self.specs))]
        return weighted_sum(self.specs, self.keys, values, errors, n)


def weighted_sum(specs: list[RewardSpec], keys: list[str], values: list[list],
                 errors: dict[str, int], n: int) -> RewardResult:
    """total_i = sum_k weight_k * values[k][i]; a None value adds 0. A skipped value (NaN, only from
    fallback: skip) is logged as missing and makes the total NaN, unless its weight is 0 (an entry
    that is only logged)."""
    result = RewardResult(total=[0.0] * n, per_reward={}, errors=errors)
    for spec, key, vals in zip(specs, keys, values):
        result.per_reward[key] = [None if v is not None and math.isnan(v) else v for v in vals]
        result.total = [t if v is None or (spec.weight == 0 and math.isnan(v))
                        else t + spec.weight * v for t, v in zip(result.total, vals)]
    return result


def prepare_rewards(specs: list[RewardSpec], context: dict,
                    given: Sequence[str] = ("num_tokens",)) -> Rewards:
    """The specs resolved once: functions, signatures, keys and judges' lanes; `given`: the
    PER_COMPLETION values the calls will pass. ValueError on a misconfiguration."""
    keys = reward_keys(specs)
    calls = [_prepare(spec, key, context, set(given)) for spec, key in zip(specs, keys)]
    # One lane per judge (by identity) and one (None) for the rest; a reward that takes `judges` may
    # call any of them, so then nothing runs at once (a Judge serves one event loop at a time).
    lanes: dict[int | None, list[int]] = {}
    for k, (_, _, kwargs, _) in enumerate(calls):
        lanes.setdefault(id(kwargs["judge"]) if "judge" in kwargs else None, []).append(k)
    parallel = (sum(key is not None for key in lanes) > 1
                and not any("judges" in kwargs for _, _, kwargs, _ in calls))
    return Rewards(list(specs), keys, calls, list(lanes.values()) if parallel else None)


def by_judge(rw: Rewards, completions: list[str], samples: list[dict], have: dict,
             errors: dict[str, int]) -> list[list]:
    """reward_values of every spec, each judge's lane in its own thread."""
    values: list = [None] * len(rw.specs)

    def run(lane: list[int]) -> None:
        for k in lane:
            values[k] = reward_values(rw, k, completions, samples, have, errors)
    futures = [in_background(functools.partial(run, lane)) for lane in rw.lanes]
    concurrent.futures.wait(futures)  # every lane done before anything is raised or returned
    for future in futures:
        future.result()  # raises what its lane raised
    return values


def reward_values(rw: Rewards, k: int, completions: list[str], samples: list[dict], have: dict,
                  errors: dict[str, int]) -> list[float | None]:
    """Reward k's value of each completion, a failure its spec's fallback (counted in errors)."""
    (fn, batched, kwargs, wants), spec, key = rw.calls[k], rw.specs[k], rw.keys[k]
    if batched:
        return batched_values(fn, kwargs, wants, spec, key, completions, samples, have, errors)
    values: list[float | None] = []
    for i, (completion, sample) in enumerate(zip(completions, samples)):
        try:  # `wants`: num_tokens, episode, the completion's own
            values.append(_as_reward(fn(completion, sample, **kwargs,
                                        **{w: have[w][i] for w in wants})))
        except Exception as err:
            values.append(fallback(err, spec, key, completion, sample, errors))
    return values


def batched_values(fn: Callable, kwargs: dict, wants: list[str], spec: RewardSpec, key: str,
                   completions: list[str], samples: list[dict], have: dict,
                   errors: dict[str, int]) -> list[float | None]:
    """reward_values of a batched reward: one call for every completion."""
    n, values = len(completions), []
    try:
        out = fn(completions, samples, **kwargs, **{w: have[w] for w in wants})
        if not isinstance(out, (list, tuple)) or len(out) != n:
            raise TypeError(f"batched reward returned {_short(out, 80)}; "
                            f"expected a list of {n} values")
    except Exception as err:
        value = fallback(err, spec, key, completions[0] if n else "", samples[0] if n else {},
                         errors)
        errors[key] += n - 1 if n else 0  # the whole batch got the fallback: each counts
        return [value] * n
    for value, completion, sample in zip(out, completions, samples):
        try:
            values.append(_as_reward(value))
        except TypeError as err:
            values.append(fallback(err, spec, key, completion, sample, errors))
    return values


def fallback(err: Exception, spec: RewardSpec, key: str, completion: str, sample: dict,
             errors: dict[str, int]) -> float:
    """A reward that failed on one completion: its spec's fallback (NaN: skip), counted in errors;
    its first failure logged with a traceback."""
    # a refused key, an unknown model, a reward model too big for the GPU, an environment's
    # get_reward that returns text: every later call fails too
    if isinstance(err, (JudgeUnusable, torch.OutOfMemoryError, ConfigError)):
        raise err
    errors[key] += 1
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning("reward %r failed (%s), using fallback %s; later failures are only "
                    "counted. sample=%s completion=%s", key,
                    str(err) if isinstance(err, _NoValue) else one_line(err), spec.fallback,
                    _short(sample), _short(completion),
                    exc_info=None if isinstance(err, _NoValue) else err)
    return math.nan if spec.fallback == "skip" else spec.fallback  # NaN: skipped


def _prepare(spec: RewardSpec, key: str, context: dict,
             given: set[str]) -> tuple[Callable, bool, dict, list[str]]:
    """(function, batched, its keyword arguments, the PER_COMPLETION values it takes) for one spec;
    ValueError on a misconfiguration, which would fail the same way on every sample."""
    fn, batched = resolve(spec)
    params = {p.name: p for p in reward_params(fn)}
    kwargs = {**{k: v for k, v in context.items() if k in params}, **spec.args}  # args win
    if isinstance(kwargs.get("judge"), str):  # args: {judge: NAME}: that one of context["judges"]
        if kwargs["judge"] not in context.get("judges", {}):
            raise ValueError(f"reward {key!r}: no judge named {kwargs['judge']!r} "
                             "in context['judges']")
        kwargs["judge"] = context["judges"][kwargs["judge"]]
    wants = [k for k in PER_COMPLETION if k in params]
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in kwargs
               and p.name not in PER_COMPLETION
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ValueError(f"reward {key!r} needs {', '.join(missing)}: set it under args "
                         "or pass it in context")
    for k in [k for k in wants if k not in given and params[k].default is params[k].empty]:
        raise ValueError(f"reward {key!r} needs {k}: pass {k}= to compute_rewards" + (
            " (an episode: set env: or tools:)" if k == "episode" else ""))
    return fn, batched, kwargs, [k for k in wants if k in given]


def resolve(spec: RewardSpec) -> tuple[Callable, bool]:
    """The (function, batched) a spec names; ValueError with a one-line hint when there is none."""
    name = spec.name
    if ":" not in name:
        found = lookup(name)
        if found:
            return found
        raise ValueError(f"unknown reward {name!r}{did_you_mean(name, names())}; registered: "
                         f"{', '.join(names())}; or write 'package.module:function' or "
                         "'path/to/file.py:function'")
    fn = import_function(name)
    # a user function marks itself batched by registering: @register("name", batched=True)
    registered = next((batched for f, batched in REGISTRY.values() if f is fn), None)
    if registered is None and is_trl_reward(fn):
        return trl_reward(fn), True
    return fn, bool(registered)


def reward_params(fn: Callable) -> tuple[inspect.Parameter, ...]:
    """The parameters after (completion, sample): those that args, num_tokens or context fill."""
    return tuple(inspect.signature(fn).parameters.values())[2:]


def reward_keys(specs: list[RewardSpec]) -> list[str]:
    """Result keys: the spec's label or name, or "name#2", "name#3" when one repeats (other args).

    >>> reward_keys([RewardSpec("judge"), RewardSpec("judge", label="clarity"),
    ...              RewardSpec("judge")])
    ['judge', 'clarity', 'judge#2']
    """
    seen: dict[str, int] = {}
    keys = []
    for spec in specs:
        key = spec.label or spec.name
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return keys


class _NoValue(TypeError):
    """A reward returned NaN, its way of saying it has no value here (a judge call that failed and
    was reported by the judge itself): counted and given the fallback, logged with no traceback."""


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real) and math.isfinite(value):  # bool is a Real: True -> 1.0
        return float(value)
    if isinstance(value, numbers.Real) and math.isnan(value):
        raise _NoValue("returned NaN (no value: a failed judge call, say)")
    raise TypeError(f"reward returned {value!r}; expected a finite number or None")


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


def reward_context(assistant_prefix: str, judges: dict, forced_prefix: str | None = None,
                   group_size: int | None = None) -> dict:
    """The context training and eval score with: the start of each reply the policy did not write
    (rollout.reply_prefix: the forced data.assistant_prefix, from a think block the chat template
    opens), the forced prefix alone (`forced_prefix`: what graders/ratings.py's queue keeps, since
    its exported replies meet the template again), the judge: section's judge (`judge`), every
    judge by name (`judges`, for args: {judge: NAME}) and the completions a prompt has
    (`group_size`: G, consecutive in a batch; judge.group_judge's groups)."""
    return {"assistant_prefix": assistant_prefix,
            "forced_prefix": assistant_prefix if forced_prefix is None else forced_prefix,
            "judge": judges.get("judge"), "judges": judges, "group_size": group_size}


def join_results(parts: list[RewardResult]) -> RewardResult:
    """Results of consecutive slices of one batch as one: values in order, errors summed.

    >>> join_results([RewardResult([1.0], {"a": [1.0]}, {"a": 2}),
    ...               RewardResult([0.0], {"a": [None]}, {"a": 3})])
    RewardResult(total=[1.0, 0.0], per_reward={'a': [1.0, None]}, errors={'a': 5})
    """
    out = RewardResult(total=[], per_reward={}, errors={})
    for p in parts:
        out.total += p.total
        for k, v in p.per_reward.items():
            out.per_reward.setdefault(k, []).extend(v)
        for k, n in p.errors.items():
            out.errors[k] = out.errors.get(k, 0) + n
    return out


def in_background(fn: Callable[[], Any],
                  after: concurrent.futures.Future | None = None) -> concurrent.futures.Future:
    """fn() in a daemon thread, started once `after` is done (train.py scores its slices, eval.py
    its models, one at a time and in order: a Judge serves one event loop at a time). A daemon, so a
    Ctrl-C while it waits for a judge or people's ratings exits at once, not waiting for them."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if after is not None:
            concurrent.futures.wait([after])  # its error, if any, is raised where it is read
        try:
            future.set_result(fn())
        except BaseException as err:  # handed to whoever reads the result
            future.set_exception(err)
    threading.Thread(target=run, name="rewards", daemon=True).start()
    return future


def reward_means(per_reward: dict[str, list[float | None]]) -> dict[str, float]:
    """Mean of the non-None values of each reward, for logging `rewards/<name>/mean`.

    >>> reward_means({"a": [1.0, None, 0.0], "b": [None, None]})
    {'a': 0.5}
    """
    return {k: sum(vs) / len(vs) for k, v in per_reward.items()
            if (vs := [x for x in v if x is not None])}


def advantage_rewards(total: torch.Tensor, per_reward: dict[str, list[float | None]],
                      specs: list[RewardSpec], grpo_cfg, group_size: int) -> torch.Tensor:
    """What the group advantages are taken of (grpo.reward_aggregation): `total`, the weighted sum
    (sum), or grpo.normalize_then_sum of the rewards; a skipped completion (NaN total) stays NaN.
    total: (N,); per_reward: the rewards' (N,) values by reward_keys(specs). Returns (N,)."""
    if grpo_cfg.reward_aggregation == "sum":
        return total
    values = torch.tensor([[math.nan if v is None else v for v in per_reward[key]]
                           for key in reward_keys(specs)], dtype=torch.float32).T  # (N, K)
    weights = torch.tensor([spec.weight for spec in specs], dtype=torch.float32)  # (K,)
    summed = grpo.normalize_then_sum(values, weights, group_size,
                                     zero_std_tol=grpo_cfg.zero_std_tol)  # (N,)
    return torch.where(torch.isnan(total), math.nan, summed.to(total))  # (N,)


# ---------------------------------------------------- rewards in other files, registered when named
# The judge's rewards (judge.py) and the graders (graders/) register themselves when their module is
# imported; lookup imports it the first time a config names one, so the core never imports graders/
# (`import train` loads no rating page).
ELSEWHERE = {"json_valid": "graders.json_answers", "json_schema": "graders.json_answers",
             "choice_accuracy": "graders.json_answers", "human": "graders.ratings",
             "judge": "judge", "rubric_alignment": "judge", "group_judge": "judge",
             "reward_model": "graders.reward_model",
             "citation_grounding": "graders.citations", "invented_citation": "graders.citations",
             "citation_pass": "graders.citations", "get_reward": "engines.environments",
             "rubric_format": "graders.rubrics"}


def lookup(name: str) -> tuple[Callable, bool] | None:
    """The (function, batched) registered under `name`, its module imported first if need be."""
    if name not in REGISTRY and name in ELSEWHERE:
        importlib.import_module(ELSEWHERE[name])
    return REGISTRY.get(name)


def names() -> list[str]:
    """Every name a config may give a reward by: registered, or registered when first looked up."""
    return sorted(set(REGISTRY) | set(ELSEWHERE))
