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

import difflib
import inspect
import types
import typing
from typing import Callable, Collection

from api.client import Judge
from config import Config, ConfigError, RewardSpec, judge_names, judge_sections
from data import check_not_data_file
from engines.environments import check_environment
from judge import open_judges
from rewards import PER_COMPLETION, resolve, reward_keys, reward_params
from settings.typed_config import check_writable, convert
from sources.plugins import did_you_mean


def open_scoring(cfg: Config, check_rewards: bool = True) -> dict[str, Judge]:
    """train.py's and eval.py's checks of the rewards and judges, then the judges opened, by name
    ("judge" for the judge: section). Any failure here is a ConfigError, before any model loads."""
    check_environment(cfg)  # env: or tools:, whose episodes the rewards score; get_reward joins
    try:
        if check_rewards:
            check_specs(cfg.rewards, judges=judge_names(cfg))
    except ValueError as e:
        raise ConfigError(f"rewards: {e}") from None
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




def check_specs(specs: list[RewardSpec], judges: Collection[str] = ("judge",)) -> None:
    """Fail early, before any model loads: every reward resolves and accepts its args (and passes
    its own `check_args(**args)`, where it has one), and a judge-based reward (one taking `judge`)
    has its judge to call: args.judge names one of `judges` (default "judge", the judge: section).
    A named judge that no reward calls is an error too: most often a mistyped override made it."""
    if not specs:
        raise ValueError("no rewards configured: add at least one entry under `rewards:` (or "
                         "give env: a class with a get_reward method)")
    used = {"judge"}  # the judge: section may go unused (a recipe's judge, overridden rewards)
    for spec in specs:
        fn, _ = resolve(spec)
        params = reward_params(fn)
        used |= _judges_called(spec, params, judges)
        _check_arg_names(spec, params)
        _check_signature(fn, spec)
        # the reward's own check of its args' values (ratings.human)
        if callable(getattr(fn, "check_args", None)):
            fn.check_args(**spec.args)
        _check_arg_types(fn, spec)
    _check_judges_used(judges, used)


def _judges_called(spec: RewardSpec, params: tuple[inspect.Parameter, ...],
                   judges: Collection[str]) -> set[str]:
    """The judges one reward may call (all of them for one taking `judges`); its args.judge must
    name a configured one."""
    names = {p.name for p in params}
    used = set(judges) if "judges" in names else set()  # a reward that may call any of them
    if "judge" not in names:
        return used
    name = spec.args.get("judge", "judge")
    if not isinstance(name, str):
        raise ValueError(f"reward {spec.name!r}: args.judge={name!r} must be the name of "
                         "a judge")
    if name == "judge" and name not in judges:
        raise ValueError(f"reward {spec.name!r} needs a judge: add a `judge:` section "
                         "(base_url, model, api_key_env)"
                         + (f", or name one of judges: ({', '.join(judges)}) with "
                            "args: {judge: NAME}" if judges else ""))
    if name not in judges:
        raise ValueError(f"reward {spec.name!r}: args.judge={name!r} is not a configured "
                         f"judge; configured: {', '.join(map(repr, judges)) or 'none'} "
                         "(judges: names them)")
    return used | {name}


def _check_arg_names(spec: RewardSpec, params: tuple[inspect.Parameter, ...]) -> None:
    """Every key of spec.args is a parameter of the reward, and none is one the trainer fills."""
    for filled in [k for k in PER_COMPLETION if k in spec.args]:
        raise ValueError(f"reward {spec.name!r}: {filled} is filled in by the trainer; "
                         "remove it from args")
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for arg in spec.args:
        if arg not in names and not any(p.kind is p.VAR_KEYWORD for p in params):
            raise ValueError(f"reward {spec.name!r} has no argument {arg!r}"
                             f"{did_you_mean(arg, names)}; "
                             f"it accepts: {', '.join(names) or 'no arguments'}")


def _check_signature(fn: Callable, spec: RewardSpec) -> None:
    """The reward takes two positional arguments: (completion, sample) or TRL's (prompts,
    completions)."""
    every = inspect.signature(fn).parameters.values()
    positional = [p for p in every
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    # (completion, **kw) too
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in positional):
        raise ValueError(f"reward {spec.name!r}: a reward takes (completion, sample, **args) "
                         "(batched: lists of both), or as TRL's take them, "
                         "(prompts, completions, **kwargs); "
                         f"{getattr(fn, '__name__', fn)}{inspect.signature(fn)} does not")


def _check_judges_used(judges: Collection[str], used: set[str]) -> None:
    """Every named judge is called by some reward: most often a typo in an override made a new
    one."""
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






















