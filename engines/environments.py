"""Environments written for TRL's GRPOTrainer(environment_factory=...), run unchanged as minigrpo's
multi-turn episodes: the class's public methods are the tools, reset(**row) opens each rollout,
get_reward() is one more reward. engines/episodes.py plays the turns; this module holds what an
environment is, kept to the rules of trl 1.16's GRPOTrainer (trainer/grpo_trainer.py).

    env: {name: my_env.py:Counter, args: {start: 0}}         # one class, or a function making one
    env: {names: {math: calc.py:Calculator, game: game.py:Wordle}}  # each row's `environment`
    tools: [my_tools.py:search]                              # functions, with or without an env
    python -m pytest -q tests/test_environments.py

    class Counter:
        def reset(self, **row) -> str | None:   # every column of the row; a string it returns is
            self.count = 0                      # appended to the last user message
        def increment(self, step: int) -> int:  # each public method is a tool
            '''Adds `step` to the counter.

            Args:
                step: how much to add
            '''
            self.count += step
            return self.count
        def get_reward(self) -> float:          # optional: one more reward, logged as "Counter"
            return float(self.count == 3)

TRL's rules, kept here:
- tools: the functions of inspect.getmembers(type(env)) but reset, get_reward and _private ones,
  bound to the rollout's instance; each one's schema is transformers' get_json_schema(method), what
  apply_chat_template(tools=[method]) renders (type hints, a docstring with Args:); the `tools:`
  functions come first, then the methods by name.
- instances: one per rollout of a batch, kept in a pool and reset by later batches ("construct
  once, reset often"); the one built at setup to read the class is the pool's first.
- reset(**row): the row's columns (with env.names: not `environment`).
- get_reward(): {name: get_reward, label: <its class's name>, weight: 1} joins the rewards, unless
  rewards: lists it (then with that weight); None for a rollout of another class.
- a call: answered as TRL answers it (engines/tool_calls.py); a reply without one ends the episode.

What stops a run with one line (exit 2): a factory that raises, a class without reset, a tool
without type hints or an Args: docstring (at setup, before any model loads); a row whose
`environment` names no entry of env.names (setup); a get_reward that returns something other than
a number or None (on the first such rollout).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from dataclasses import dataclass, field
from typing import Callable

from config import Config, ConfigError, RewardSpec
from engines import tool_calls
from rewards import register
from sources.plugins import import_function, on_reward_loop, one_line

COLUMN = "environment"  # the row column that picks an entry of env.names (TRL's)
NOT_TOOLS = ("reset", "get_reward")


@dataclass
class Environments:
    """A run's environments, opened once (open_environments): each by its key (None: env.name's),
    its factory, the tools' schemas its rollouts see, its class's name where it has get_reward; the
    instances built so far (TRL's pool); and the standalone tools (tools:)."""
    factories: dict[str | None, Callable]
    schemas: dict[str | None, list[dict]]  # tools:'s, then the environment's methods'
    rewarded: dict[str | None, str]  # key -> class name, for the classes with a get_reward
    functions: dict[str, Callable]  # tools:, by name
    fmt: str  # tool_calls.call_format: "hermes" or "json"
    timeout: float  # rollout.tool_timeout
    keyed: bool = False  # env.names: each row's `environment` column picks one
    pool: dict[str | None, list] = field(default_factory=dict)


def open_environments(cfg: Config, tokenizer) -> Environments:
    """The config's environments, each read from one instance (the pool's first), and the `tools:`
    functions. ValueError with one line when a factory cannot be imported or raises, builds
    something without reset, or a tool has no schema."""
    functions = {}
    for name in cfg.tools:
        fn = import_function(name, what="tool")
        functions[fn.__name__] = fn
    standalone = [tool_calls.tool_schema(fn, name) for name, fn in functions.items()]
    envs = Environments({}, {None: standalone}, {}, functions,
                        tool_calls.call_format(tokenizer), cfg.rollout.tool_timeout,
                        keyed=bool(cfg.env and cfg.env.names))
    for key, name in factory_names(cfg).items():
        factory = functools.partial(import_function(name, what="env"),
                                    **(cfg.env.args if key is None else {}))
        instance = build(factory, name)
        members = dict(inspect.getmembers(type(instance), inspect.isfunction))
        if "reset" not in members:
            raise ValueError(f"env {name!r} built a {type(instance).__name__}, which has no "
                             "reset method (TRL's environments define reset(self, **kwargs))")
        label = type(instance).__name__
        envs.schemas[key] = standalone + [tool_calls.tool_schema(fn, f"{label}.{fn.__name__}")
                                          for fn in tool_methods(instance).values()]
        if "get_reward" in members:
            envs.rewarded[key] = label
        envs.factories[key], envs.pool[key] = factory, [instance]
    return envs


def factory_names(cfg: Config) -> dict[str | None, str]:
    """env.name under the key None, or env.names as they are; {} with tools: alone."""
    if not cfg.env:
        return {}
    return {None: cfg.env.name} if cfg.env.name else dict(cfg.env.names)


def build(factory: Callable, label) -> object:
    """factory() -> a new environment; ValueError in one line when it raises."""
    try:
        return factory()
    except Exception as e:
        raise ValueError(f"env {label!r}: building it raised {one_line(e)}") from None


def tool_methods(env) -> dict[str, Callable]:
    """The environment's tools, as TRL finds them: its class's functions but reset, get_reward and
    the private ones, bound to this instance, by name (so, sorted)."""
    if env is None:
        return {}
    return {name: getattr(env, name)
            for name, _ in inspect.getmembers(type(env), inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")}


def tools_of(envs: Environments, env) -> dict[str, Callable]:
    """What a rollout's calls may name: the `tools:` functions and its environment's methods."""
    return envs.functions | tool_methods(env)


def env_key(envs: Environments, row: dict) -> str | None:
    """The key of the row's environment: None (env.name, or tools: alone), or its `environment`
    column, which must name an entry of env.names (ConfigError otherwise)."""
    if not envs.keyed:
        return None
    if row.get(COLUMN) not in envs.factories:
        raise ConfigError(unknown_environment(row, envs.factories))
    return row[COLUMN]


def unknown_environment(row: dict, known) -> str:
    return (f"env.names: a row has {COLUMN}={row.get(COLUMN)!r}, which env.names does not name "
            f"(it has {', '.join(map(str, known))}); fix the rows' {COLUMN!r} column or add it")


def draw(envs: Environments, keys: list) -> list:
    """An instance for each rollout, in order: the pool's, and a new one only when this batch needs
    more of an environment than were built so far (TRL's pool). None with tools: alone."""
    taken: dict = {}
    out = []
    for key in keys:
        if key not in envs.factories:
            out.append(None)
            continue
        pool, i = envs.pool[key], taken.get(key, 0)
        if i == len(pool):
            try:
                pool.append(build(envs.factories[key], key or "env.name"))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        taken[key] = i + 1
        out.append(pool[i])
    return out


def reset(envs: Environments, env, row: dict) -> str | None:
    """env.reset(**row), as TRL calls it: every column of the row (env.names: not `environment`);
    a string it returns is text to append to the last user message; None: nothing."""
    if env is None:
        return None
    said = env.reset(**({k: v for k, v in row.items() if k != COLUMN} if envs.keyed else row))
    if said is not None and not isinstance(said, str):
        raise TypeError(f"reset returned {type(said).__name__}; minigrpo's episodes are text: "
                        "return a str or None")
    return said


# ---------------------------------------------------------------- checks, and get_reward


def check_environment(cfg: Config) -> None:
    """Before any model loads: each environment builds, has reset, and every tool has its schema
    (ConfigError, one line, else); then each class's get_reward joins cfg.rewards (with_env_rewards)
    so that it is checked, weighted, logged and saved like any reward."""
    if not (cfg.env or cfg.tools):
        return
    try:
        envs = open_environments(cfg, None)
    except ValueError as e:
        raise ConfigError(f"{'env' if cfg.env else 'tools'}: {e}") from None
    cfg.rewards = with_env_rewards(cfg.rewards, envs.rewarded)


def check_rows(cfg: Config, rows: list[dict]) -> None:
    """env.names: every data row names one of them in its `environment` column."""
    if cfg.env and cfg.env.names:
        for row in rows:
            if row.get(COLUMN) not in cfg.env.names:
                raise ConfigError(unknown_environment(row, cfg.env.names))


def with_env_rewards(specs: list[RewardSpec], rewarded: dict) -> list[RewardSpec]:
    """The rewards with TRL's get_reward added: for each class that has one, {name: get_reward,
    label: <class>, weight: 1.0, args: {env_class: <class>}}, unless the specs list it already (a
    get_reward entry for that env_class, or without one when there is one class), whose label is
    then the class's name unless it has its own.

    >>> [(s.label, s.weight) for s in with_env_rewards([RewardSpec("answer_match")], {None: "C"})]
    [(None, 1.0), ('C', 1.0)]
    >>> with_env_rewards([RewardSpec("get_reward", weight=0.5)], {None: "C"})[0].label
    'C'
    """
    classes = list(dict.fromkeys(rewarded.values()))
    out, listed = [], set()
    for spec in specs:
        if spec.name == "get_reward":
            cls = spec.args.get("env_class") or (classes[0] if len(classes) == 1 else None)
            listed.add(cls)
            spec = dataclasses.replace(spec, label=spec.label or cls)
        out.append(spec)
    return out + [RewardSpec("get_reward", weight=1.0, label=cls, args={"env_class": cls})
                  for cls in classes if cls not in listed]


@register("get_reward")
def get_reward(completion: str, sample: dict, episode, env_class: str | None = None):
    """The environment's own score of its rollout, env.get_reward() (awaited if async), TRL's
    environment reward; None for a rollout whose environment is of another class than env_class,
    or has no get_reward. An environment whose reset raised has none: ValueError, so the spec's
    fallback applies. A value that is neither a number nor None stops the run (ConfigError)."""
    env = episode.env
    if env is None or (env_class and type(env).__name__ != env_class) or not callable(
            getattr(env, "get_reward", None)):
        return None
    if episode.error:
        raise ValueError(episode.error)
    value = env.get_reward()
    value = on_reward_loop(value) if inspect.isawaitable(value) else value
    value = value.item() if hasattr(value, "item") and not isinstance(value, float) else value
    if value is not None and not isinstance(value, numbers.Real):
        raise ConfigError(f"{type(env).__name__}.get_reward() returned {str(value)[:80]!r} "
                          f"({type(value).__name__}); it must return a number (or None: no value)")
    return value
