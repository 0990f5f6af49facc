"""The user's own functions: a reward or a data map named "path/to/file.py:function" or
"package.module:function", loaded once; and reward functions written for TRL's GRPOTrainer (they
take `completions` by name and return a list), run unchanged as batched minigrpo rewards.

    rewards: [{name: my_rewards.py:no_hedging}, {name: medmcqa_rewards.py:accuracy_reward}]  # both
    python -m pytest --doctest-modules sources/plugins.py tests/test_scoring.py

resolve(spec) is what scoring.py calls: a registered name (rewards.REGISTRY) or one of these.
"""
from __future__ import annotations

import asyncio
import difflib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import threading
from pathlib import Path
from typing import Callable


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _load_file(path: str, label: str):
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"{label}: file {path} not found (relative paths start at {Path.cwd()})")
    module_name = "_minigrpo_reward_" + re.sub(r"\W", "_", str(file))
    if module_name in sys.modules:  # load each file once: its module state survives between calls
        return sys.modules[module_name]
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location(module_name, file))
    sys.modules[module_name] = module  # dataclasses and pickle look a module up here while it runs
    try:
        module.__spec__.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ValueError(f"{label}: could not load {path}: {one_line(err)}") from err
    return module


def import_function(name: str, what: str = "reward") -> Callable:
    """The function "package.module:function" or "path/to/file.py:function" names (user rewards,
    data maps); ValueError with a one-line hint when there is none."""
    label = f"{what} {name!r}"
    where, attr = name.rsplit(":", 1)
    if where.endswith(".py"):
        module = _load_file(where, label)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as err:
            raise ValueError(f"{label}: cannot import module {where!r} ({one_line(err)}); "
                             "is it installed or on PYTHONPATH?") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ValueError(f"{label}: {where} has no function {attr!r}{did_you_mean(attr, public)}")
    return fn




TRL_FILLED = ("prompts", "completions", "environments")  # what a TRL reward gets besides the
#   data's columns (environments: multi-turn episodes' environment instances)


def is_trl_reward(fn: Callable) -> bool:
    """A reward written for TRL's GRPOTrainer: it takes `completions` (and `prompts`) by name and
    returns a list; minigrpo's own take (completion, sample) or, batched, (completions, samples).

    >>> is_trl_reward(lambda completions, **kwargs: []), is_trl_reward(
    ...     lambda prompts, completions, answer, **kw: [])
    (True, True)
    >>> is_trl_reward(lambda completion, sample: 0), is_trl_reward(lambda completions, samples: [])
    (False, False)
    """
    names = [p.name for p in inspect.signature(fn).parameters.values()]
    return "completions" in names and names[:2] != ["completions", "samples"]


def per_function(make: Callable) -> Callable:
    """make(fn), computed once per function object, by identity (lru_cache hashes: a callable
    instance of a dataclass is unhashable). The functions are kept, as a run keeps its rewards."""
    memo: dict[int, tuple] = {}

    @functools.wraps(make)
    def get(fn):
        hit = memo.get(id(fn))
        if hit is None or hit[0] is not fn:
            memo[id(fn)] = hit = (fn, make(fn))
        return hit[1]
    return get


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def on_reward_loop(awaitable):
    """The awaitable's result, run on one event loop that lives as long as the process (a daemon
    thread), as TRL runs async rewards: a reward that keeps an AsyncOpenAI client, a lock or a
    semaphore between calls finds them bound to the same loop every step (a fresh loop per call,
    asyncio.run's, failed them from the second step on)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="minigrpo-async-rewards",
                             daemon=True).start()

    if threading.current_thread().name == "minigrpo-async-rewards":  # .result() would deadlock here
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # never run: no "was never awaited" warning
        raise RuntimeError("an async reward called another wrapped async reward from inside the "
                           "reward loop; await it")

    async def wait():
        return await awaitable
    future = asyncio.run_coroutine_threadsafe(wait(), _LOOP)
    try:
        return future.result()
    except BaseException:  # Ctrl-C while waiting: cancel it, or it runs on, holding what it holds
        future.cancel()
        raise


def environments(episode: list | None) -> dict:
    """TRL's `environments` keyword: each completion's environment instance, in multi-turn runs
    against an environment class ({} otherwise, as TRL passes none)."""
    if not episode or all(e.env is None for e in episode):
        return {}
    return {"environments": [e.env for e in episode]}


@per_function
def trl_reward(fn: Callable) -> Callable:
    """fn(prompts=[...], completions=[...], **columns, **args) -> list, as TRL calls it, wrapped as
    a batched minigrpo reward (an async one awaited): `prompts` are the rows' prompts (text or chat
    messages), `completions` the completions' TEXT, also for chat prompts (TRL's conversational
    format hands lists of {role, content} messages instead: the MedMCQA project's
    json.loads(completion) failed on every one of them and its rewards were 0.0 throughout), and
    each other column of the rows is a keyword holding its values in order (TRL's reward_kwargs);
    in multi-turn episodes against an environment class, `environments` is each completion's
    environment instance, as TRL passes them. A None in the returned list: no value, as in TRL.
    Arguments TRL fills that minigrpo does not have (completion_ids, trainer_state) must have
    defaults."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    required = [n for n, p in params.items()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    label = f"reward {getattr(fn, '__name__', fn)!r} (TRL's signature {inspect.signature(fn)})"

    def batched(completions: list[str], samples: list[dict], episode: list | None = None,
                **args) -> list:
        columns = {k for s in samples for k in s
                   if k != "prompt" and (takes_any or k in params)} - set(args)
        kwargs = {k: [s.get(k) for s in samples] for k in columns} | args
        kwargs |= environments(episode) if takes_any or "environments" in params else {}
        kwargs |= {k: v for k, v in (("prompts", [s.get("prompt") for s in samples]),
                                     ("completions", list(completions)))
                   if takes_any or k in params}
        try:
            out = fn(**kwargs)
            if inspect.isawaitable(out):  # async def, as TRL awaits them
                out = on_reward_loop(out)
        except TypeError as e:
            if "string indices" in str(e):  # completion[0]["content"]: TRL's conversational format
                raise TypeError(f"{e}: completions are passed as text here, not as lists of "
                                "{role, content} messages; read the text itself") from e
            raise
        # TRL iterates what it gets: a numpy array, a generator; numpy and torch scalars as numbers
        if not isinstance(out, (str, bytes, dict)) and hasattr(out, "__iter__"):
            out = [v.item() if hasattr(v, "item") and not isinstance(v, (int, float)) else v
                   for v in out]
        return out

    def check_args(**args) -> None:
        if unknown := [a for a in args if a not in params and not takes_any]:
            raise ValueError(f"{label} has no argument {unknown[0]!r}")
        if unfilled := [n for n in required if n in ("completion_ids", "trainer_state")]:
            raise ValueError(f"{label} needs {unfilled[0]}, which minigrpo does not pass; "
                             "give it a default (None)")
        if "prompt" in required:  # TRL leaves the prompt column out of the keywords, like minigrpo
            raise ValueError(f"{label} takes 'prompt', which neither TRL nor minigrpo passes; "
                             "take 'prompts' (the list)")

    def columns(**args) -> list[str]:  # check_rows: each must be in a row (others get None)
        return [n for n in required if n not in (*TRL_FILLED, *args)]
    batched.check_args, batched.columns, batched.trl = check_args, columns, fn
    batched.__name__ = getattr(fn, "__name__", "trl_reward")
    return batched


