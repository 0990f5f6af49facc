"""Scoring: every configured reward over a batch of completions, weighted and summed (the rewards
are in rewards.py).

    check_specs(cfg.rewards, judges=judge_names(cfg))  # before any model loads: names, args, judges
    open_rewards(cfg.rewards)                          # then a reward model loads (graders/)
    res = compute_rewards(texts, samples, cfg.rewards, num_tokens=lengths,
                          context=reward_context(prefix, judges))
    res.total, res.per_reward, res.errors              # (N,); name -> (N,) values; name -> failures

    total_i = sum_k weight_k * r_k(completion_i, sample_i)   (a None r_k adds 0; a skipped one
                                                               makes it NaN, unless its weight is 0)

compute_rewards fills a reward's parameters named `num_tokens`, `episode` (multi-turn: the
completion's episodes.Episode, the whole conversation) or after a key of its context
(`judge`, `judges`, `assistant_prefix`, `forced_prefix`); a judge-based reward with
`args: {judge: NAME}` gets that one of context["judges"]. A reward that raises or returns a
non-number never stops a run: it gets the spec's fallback (NaN for fallback: skip), is counted in
`errors`, and its first failure is logged. Rewards on different judges run at once, each judge's
in config order (its cache answers its later entries). compute_rewards itself may run in a
background thread (`in_background`, one call at a time, in order): train.py's while the next slice
samples (rollout.prompts_per_generate), eval.py's while the next model generates.
"""
from __future__ import annotations

import concurrent.futures
import difflib
import functools
import inspect
import logging
import math
import numbers
import threading
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Collection

import torch

from api.client import Judge, JudgeUnusable
from config import Config, ConfigError, RewardSpec, judge_names, judge_sections
from data import check_not_data_file
from engines.episodes import check_environment
from judge import open_judges
from settings.typed_config import check_writable, convert
from sources.plugins import did_you_mean, one_line, resolve, reward_params

log = logging.getLogger("minigrpo.scoring")


@dataclass
class RewardResult:
    total: list[float]  # (N,) weighted sum; a None component adds 0; NaN: skipped (fallback: skip)
    per_reward: dict[str, list[float | None]]  # (N,) raw values per reward; keys: reward_keys
    errors: dict[str, int]  # per reward: completions it failed to score (a batched call that
    #   raises: each of its completions)


def open_scoring(cfg: Config, check_rewards: bool = True) -> dict[str, Judge]:
    """train.py's and eval.py's checks of the rewards and judges, then the judges opened, by name
    ("judge" for the judge: section). Any failure here is a ConfigError, before any model loads."""
    try:
        if check_rewards:
            check_specs(cfg.rewards, judges=judge_names(cfg))
    except ValueError as e:
        raise ConfigError(f"rewards: {e}") from None
    check_environment(cfg)  # env: or tools:, whose episodes the rewards score
    for key, j in judge_sections(cfg).items():
        check_not_data_file(cfg.data, j.cache_path, f"{key}.cache_path")
        if j.cache_path:
            check_writable(j.cache_path, f"{key}.cache_path")
    try:
        return open_judges(cfg.judge, cfg.judges)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def open_rewards(specs: list[RewardSpec]) -> None:
    """Run each reward's `open(**args)` hook (reward_model loads its model), once the cheaper checks
    have passed: a path that does not load fails as ConfigError, before the first step."""
    for spec in specs:
        fn, _ = resolve(spec)
        if callable(getattr(fn, "open", None)):
            try:
                fn.open(**spec.args)
            except ValueError as e:
                raise ConfigError(f"rewards: {e}") from None


_LOGGED: set[str] = set()  # rewards whose first failure was logged: one traceback, not thousands


def check_specs(specs: list[RewardSpec], judges: Collection[str] = ("judge",)) -> None:
    """Fail early, before any model loads: every reward resolves and accepts its args (and passes
    its own `check_args(**args)`, where it has one), and a judge-based reward (one taking `judge`)
    has its judge to call: args.judge names one of `judges` (default "judge", the judge: section).
    A named judge that no reward calls is an error too: most often a mistyped override made it."""
    if not specs:
        raise ValueError("no rewards configured: add at least one entry under `rewards:`")
    used = {"judge"}  # the judge: section may go unused (a recipe's judge, overridden rewards)
    for spec in specs:
        fn, _ = resolve(spec)
        params = reward_params(fn)
        if "judges" in {p.name for p in params}:  # a reward that may call any of them
            used.update(judges)
        if "judge" in {p.name for p in params}:
            name = spec.args.get("judge", "judge")
            if not isinstance(name, str):
                raise ValueError(f"reward {spec.name!r}: args.judge={name!r} must be the name of "
                                 "a judge")
            used.add(name)
            if name == "judge" and name not in judges:
                raise ValueError(f"reward {spec.name!r} needs a judge: add a `judge:` section "
                                 "(base_url, model, api_key_env)"
                                 + (f", or name one of judges: ({', '.join(judges)}) with "
                                    "args: {judge: NAME}" if judges else ""))
            if name not in judges:
                raise ValueError(f"reward {spec.name!r}: args.judge={name!r} is not a configured "
                                 f"judge; configured: {', '.join(map(repr, judges)) or 'none'} "
                                 "(judges: names them)")
        for filled in [k for k in PER_COMPLETION if k in spec.args]:
            raise ValueError(f"reward {spec.name!r}: {filled} is filled in by the trainer; "
                             "remove it from args")
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for arg in spec.args:
            if arg not in names and not any(p.kind is p.VAR_KEYWORD for p in params):
                raise ValueError(f"reward {spec.name!r} has no argument {arg!r}"
                                 f"{did_you_mean(arg, names)}; "
                                 f"it accepts: {', '.join(names) or 'no arguments'}")
        every = inspect.signature(fn).parameters.values()
        positional = [p for p in every
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        # (completion, **kw) too
        if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in positional):
            raise ValueError(f"reward {spec.name!r}: a reward takes (completion, sample, **args) "
                             "(batched: lists of both), or as TRL's take them, "
                             "(prompts, completions, **kwargs); "
                             f"{getattr(fn, '__name__', fn)}{inspect.signature(fn)} does not")
        # the reward's own check of its args' values (ratings.human)
        if callable(getattr(fn, "check_args", None)):
            fn.check_args(**spec.args)
        _check_arg_types(fn, spec)
    # most often a typo in an override, making a new judge
    for name in [n for n in judges if n not in used]:
        close = difflib.get_close_matches(name, sorted(used & set(judges) - {"judge"}), n=1,
                                          cutoff=0.5)
        raise ValueError(f"judges.{name} is called by no reward (args: {{judge: {name}}})"
                         + (f"; did you mean judges.{close[0]}?" if close else
                            "; name it in a reward, or drop the judges: section "
                            "(--judges={} on the command line)"))


def _check_arg_types(fn: Callable, spec: RewardSpec) -> None:
    """Each of spec.args against the reward's annotation where it has one (the built-ins all do), as
    config fields are checked: max_words: "two" fails here, not as a TypeError per completion."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: nothing to check against
        return
    for arg, value in spec.args.items():
        # args.judge names a judge (the reward gets the client); Path, Sequence, set...: a user's,
        # left to the reward
        if arg in hints and arg not in ("judge", "judges") and _checkable(hints[arg]):
            try:
                convert(value, hints[arg], f"reward {spec.name!r}: args.{arg}")
            except ConfigError as e:
                raise ValueError(str(e)) from None


def _checkable(tp) -> bool:
    """An annotation typed_config checks exactly: str, int, float, bool, Any, None, Literal, and
    unions, lists and dicts of those."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType, list, dict):
        return all(_checkable(a) for a in args)
    return (origin is typing.Literal
            or tp in (str, int, float, bool, typing.Any, type(None), list, dict))


def check_rows(specs: list[RewardSpec], rows: list[dict], what: str = "data",
               key: str = "rewards") -> None:
    """Fail early when the rewards read columns the rows lack: an argument the reward lists in its
    `row_keys` (the built-ins' gold_key, valid_key, answers_key; given, or its default) names a
    column that no row has; or a row lacks a field of a judge template (a reward's
    `row_fields(**args)`), or fails the reward's own `check_row(row, **args)`. Otherwise the reward
    would score every completion None or its fallback and the run would learn nothing, silently.
    ConfigError names the config `key`."""
    for name, spec in zip(reward_keys(specs), specs):
        fn, _ = resolve(spec)
        for p in reward_params(fn):
            column = spec.args.get(p.name, p.default)
            if (p.name in getattr(fn, "row_keys", ()) and isinstance(column, str) and rows
                    and not any(column in r for r in rows)):
                raise ConfigError(f"{key}: reward {name!r}: {p.name}={column!r} but no {what} row "
                                  f"has a column {column!r}; the rows have: {', '.join(rows[0])}")
        # a TRL reward's columns
        for column in fn.columns(**spec.args) if callable(getattr(fn, "columns", None)) else ():
            if rows and not any(column in r for r in rows):
                raise ConfigError(f"{key}: reward {name!r} reads the column {column!r} (TRL passes "
                                  f"each column by name), which no {what} row has; the rows have: "
                                  f"{', '.join(rows[0])}")
        # what each row must hold (rubric_alignment's gold scores)
        if callable(getattr(fn, "check_row", None)):
            for i, row in enumerate(rows):
                try:
                    fn.check_row(row, **spec.args)
                except ValueError as e:
                    # the row by what it holds: its number here is after the split and the mixture
                    seen_as = next((f"{k} {str(row[k])[:60]!r}"
                                    for k in ("id", "question", "prompt") if row.get(k)), "")
                    raise ConfigError(f"{key}: reward {name!r}: {what} row {i}"
                                      f"{f' ({seen_as})' if seen_as else ''}: {e}") from None
        if callable(getattr(fn, "row_fields", None)):
            needed = fn.row_fields(**spec.args)
            for i, row in enumerate(rows):
                if missing := sorted(needed - row.keys()):
                    raise ConfigError(f"{key}: reward {name!r}: its template reads "
                                      f"{{{missing[0]}}}, which {what} row {i} lacks; "
                                      f"the row has: {', '.join(row)}")


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


PER_COMPLETION = ("num_tokens", "episode")  # what compute_rewards fills, one value a completion


def _prepare(spec: RewardSpec, key: str, context: dict,
             have: dict) -> tuple[Callable, bool, dict, list[str]]:
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
    for k in [k for k in wants if have[k] is None and params[k].default is params[k].empty]:
        raise ValueError(f"reward {key!r} needs {k}: pass {k}= to compute_rewards" + (
            " (an episode: set env: or tools:)" if k == "episode" else ""))
    return fn, batched, kwargs, [k for k in wants if have[k] is not None]


def compute_rewards(completions: list[str], samples: list[dict], specs: list[RewardSpec], *,
                    num_tokens: list[int] | None = None, episodes: list | None = None,
                    context: dict | None = None) -> RewardResult:
    """Score N completions with every reward; per-sample failures become the spec's fallback.
    Rewards calling different judges run at the same time (each judge's in config order, so its
    cache answers its later entries): a second judge does not wait for the first."""
    n, context = len(completions), context or {}
    if len(samples) != n or (num_tokens is not None and len(num_tokens) != n):
        raise ValueError(f"got {n} completions, {len(samples)} samples and "
                         f"{'no' if num_tokens is None else len(num_tokens)} num_tokens; "
                         "they must match")
    keys = reward_keys(specs)
    have = {"num_tokens": num_tokens, "episode": episodes}
    calls = [_prepare(spec, key, context, have) for spec, key in zip(specs, keys)]
    errors = dict.fromkeys(keys, 0)

    def values_of(k: int) -> list[float | None]:
        (fn, batched, kwargs, wants), spec, key = calls[k], specs[k], keys[k]

        def fail(err: Exception, completion: str, sample: dict) -> float:
            # a refused key, an unknown model, a reward model too big for the GPU: every later call
            # fails too
            if isinstance(err, (JudgeUnusable, torch.OutOfMemoryError)):
                raise err
            errors[key] += 1
            if key not in _LOGGED:
                _LOGGED.add(key)
                log.warning("reward %r failed (%s), using fallback %s; later failures are only "
                            "counted. sample=%s completion=%s", key,
                            str(err) if isinstance(err, _NoValue) else one_line(err), spec.fallback,
                            _short(sample), _short(completion),
                            exc_info=None if isinstance(err, _NoValue) else err)
            return math.nan if spec.fallback == "skip" else spec.fallback  # NaN: skipped, see below

        values: list[float | None] = []
        if batched:
            try:
                out = fn(completions, samples, **kwargs, **{w: have[w] for w in wants})
                if not isinstance(out, (list, tuple)) or len(out) != n:
                    raise TypeError(f"batched reward returned {_short(out, 80)}; "
                                    f"expected a list of {n} values")
            except Exception as err:
                value = fail(err, completions[0] if n else "", samples[0] if n else {})
                errors[key] += n - 1 if n else 0  # the whole batch got the fallback: each counts
                return [value] * n
            for value, completion, sample in zip(out, completions, samples):
                try:
                    values.append(_as_reward(value))
                except TypeError as err:
                    values.append(fail(err, completion, sample))
            return values
        for i, (completion, sample) in enumerate(zip(completions, samples)):
            try:
                extra = {w: have[w][i] for w in wants}
                values.append(_as_reward(fn(completion, sample, **kwargs, **extra)))
            except Exception as err:
                values.append(fail(err, completion, sample))
        return values

    # One lane per judge (by identity) and one (None) for the rest; a reward that takes `judges` may
    # call any of them, so then nothing runs at once (a Judge serves one event loop at a time).
    lanes: dict[int | None, list[int]] = {}
    for k, (_, _, kwargs, _) in enumerate(calls):
        lanes.setdefault(id(kwargs["judge"]) if "judge" in kwargs else None, []).append(k)
    values: list = [None] * len(specs)

    def run(lane: list[int]) -> None:
        for k in lane:
            values[k] = values_of(k)
    if (sum(key is not None for key in lanes) > 1
            and not any("judges" in kwargs for _, _, kwargs, _ in calls)):
        futures = [in_background(functools.partial(run, lane)) for lane in lanes.values()]
        concurrent.futures.wait(futures)  # every lane done before anything is raised or returned
        for future in futures:
            future.result()  # raises what its lane raised
    else:
        run(list(range(len(specs))))
    result = RewardResult(total=[0.0] * n, per_reward={}, errors=errors)
    for spec, key, vals in zip(specs, keys, values):
        # a skipped value (NaN, only from fallback: skip) is logged as missing and makes the total
        # NaN, unless its weight is 0 (an entry that is only logged)
        result.per_reward[key] = [None if v is not None and math.isnan(v) else v for v in vals]
        result.total = [t if v is None or (spec.weight == 0 and math.isnan(v))
                        else t + spec.weight * v for t, v in zip(result.total, vals)]
    return result


def reward_context(assistant_prefix: str, judges: dict, forced_prefix: str | None = None) -> dict:
    """The context training and eval score with: the start of each reply the policy did not write
    (rollout.reply_prefix: the forced data.assistant_prefix, from a think block the chat template
    opens), the forced prefix alone (`forced_prefix`: what graders/ratings.py's queue keeps, since
    its exported replies meet the template again), the judge: section's judge (`judge`) and every
    judge by name (`judges`, for args: {judge: NAME})."""
    return {"assistant_prefix": assistant_prefix,
            "forced_prefix": assistant_prefix if forced_prefix is None else forced_prefix,
            "judge": judges.get("judge"), "judges": judges}


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
