"""Tests for scoring/checks.py (check_specs before anything loads) and rewards.compute_rewards:
weights, repeated names, num_tokens and context, named judges (at once, each in order), fallbacks,
batched rewards."""
import logging
import math
import re
import threading
import types

import pytest

from config import RewardSpec
from rewards import REGISTRY, compute_rewards, reward_means
from scoring.checks import check_specs
from test_rewards import _pred

# ---------------------------------------------------------------- check_specs

def test_check_specs_accepts_good_specs():
    assert check_specs([RewardSpec("json_valid", args={"allow_fence": True}),
                        RewardSpec("choice_accuracy", weight=2.0, args={"gold_key": "cop"}),
                        RewardSpec("length_penalty",
                                   args={"max_tokens": 256, "cache_tokens": 64})]) is None


def test_check_specs_rejects_an_empty_list_unknown_names_and_unknown_args():
    with pytest.raises(ValueError, match="no rewards"):
        check_specs([])
    with pytest.raises(ValueError, match="json_schema"):
        check_specs([RewardSpec("json_valid"), RewardSpec("json_shema")])
    with pytest.raises(ValueError,
                       match=r"'json_valid' has no argument 'allow_fences'.*'allow_fence'"):
        check_specs([RewardSpec("json_valid", args={"allow_fences": True})])
    with pytest.raises(ValueError, match="'completion'"):
        check_specs([RewardSpec("json_valid", args={"completion": "x"})])
    with pytest.raises(ValueError, match="num_tokens"):
        check_specs([RewardSpec("length_penalty", args={"num_tokens": 3})])


def test_check_specs_lets_a_function_with_kwargs_take_any_arg(monkeypatch):
    monkeypatch.setitem(REGISTRY, "test_kwargs", (lambda completion, sample, **kw: 1.0, False))
    check_specs([RewardSpec("test_kwargs", args={"anything": 1})])


# ---------------------------------------------------------------- compute_rewards

def test_compute_rewards_weights_components_and_skips_none_in_the_total():
    completions = [_pred("B"), _pred("C"), "not json"]
    samples = [{"answer": "B"}, {"answer": "B"}, {}]
    specs = [RewardSpec("json_valid", weight=0.5),
             RewardSpec("choice_accuracy", weight=2.0, fallback=-1.0)]
    result = compute_rewards(completions, samples, specs)
    assert result.per_reward == {"json_valid": [1.0, 1.0, 0.0], "choice_accuracy": [1.0, 0.0, None]}
    assert result.total == [2.5, 0.5, 0.0]
    assert result.errors == {"json_valid": 0, "choice_accuracy": 0}
    assert reward_means(result.per_reward) == {"json_valid": 2 / 3, "choice_accuracy": 0.5}
    assert reward_means({"choice_accuracy": [None, None]}) == {}


def test_compute_rewards_keeps_a_repeated_name_apart_with_its_own_args():
    specs = [RewardSpec("short_answer"),
             RewardSpec("short_answer", weight=-1.0, args={"max_words": 1})]
    result = compute_rewards(["a b c"], [{}], specs)
    assert result.per_reward == {"short_answer": [1.0], "short_answer#2": [pytest.approx(1 / 3)]}
    assert result.total == [pytest.approx(1 - 1 / 3)]


def test_compute_rewards_passes_num_tokens_only_to_rewards_that_take_it():
    specs = [RewardSpec("length_penalty", args={"max_tokens": 100, "cache_tokens": 50}),
             RewardSpec("short_answer")]
    result = compute_rewards(["a", "b", "c"], [{}, {}, {}], specs, num_tokens=[10, 75, 500])
    assert result.per_reward["length_penalty"] == [0.0, -0.5, -1.0]
    assert result.total == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="num_tokens"):
        compute_rewards(["a"], [{}], specs)
    with pytest.raises(ValueError, match="must match"):
        compute_rewards(["a"], [{}], specs, num_tokens=[1, 2])
    with pytest.raises(ValueError, match="must match"):
        compute_rewards(["a", "b"], [{}], specs, num_tokens=[1, 2])


def test_compute_rewards_passes_context_keys_a_reward_asks_for(monkeypatch):
    seen = []

    def judged(completion, sample, judge, scale=1.0):
        seen.append(judge)
        return judge(completion) * scale
    monkeypatch.setitem(REGISTRY, "test_judged", (judged, False))
    judge = len
    # json_valid takes no judge
    specs = [RewardSpec("test_judged", args={"scale": 2.0}), RewardSpec("json_valid")]
    result = compute_rewards(["ab", "{}"], [{}, {}], specs,
                             context={"judge": judge, "unused": object()})
    assert result.per_reward == {"test_judged": [4.0, 4.0], "json_valid": [0.0, 1.0]}
    assert seen == [judge, judge]
    with pytest.raises(ValueError, match="'test_judged' needs judge"):
        compute_rewards(["ab"], [{}], specs)


def test_a_named_judge_in_args_picks_that_judge_from_context_judges(monkeypatch):
    def judged(completion, sample, judge):
        return judge(completion)
    monkeypatch.setitem(REGISTRY, "test_named_judge", (judged, False))
    first, second = len, lambda text: 10.0 * len(text)
    specs = [RewardSpec("test_named_judge"),
             RewardSpec("test_named_judge", label="second", args={"judge": "second"})]
    context = {"judge": first, "judges": {"judge": first, "second": second}}
    result = compute_rewards(["ab", "c"], [{}, {}], specs, context=context)
    assert result.per_reward == {"test_named_judge": [2.0, 1.0], "second": [20.0, 10.0]}
    with pytest.raises(ValueError, match="no judge named 'third'"):
        # a misconfiguration raises, it is not a fallback
        compute_rewards(["ab"], [{}], [RewardSpec("test_named_judge", args={"judge": "third"})],
                        context=context)


def test_rewards_on_different_judges_run_at_once_and_each_judge_s_own_in_order(monkeypatch):
    started = {"a": threading.Event(), "b": threading.Event()}
    order = []

    def judged(completions, samples, *, judge, tag):
        order.append((judge.name, tag))
        started[judge.name].set()
        # at once: each sees the other start
        met = started["b" if judge.name == "a" else "a"].wait(timeout=5)
        return [1.0 if met else 0.0] * len(completions)
    monkeypatch.setitem(REGISTRY, "test_lanes", (judged, True))
    judges = {"first": types.SimpleNamespace(name="a"), "second": types.SimpleNamespace(name="b")}
    specs = [RewardSpec("test_lanes", label=f"{j}_{t}", args={"judge": j, "tag": t})
             for j, t in [("first", "x"), ("second", "x"), ("first", "y")]]
    result = compute_rewards(["c"], [{}], specs, context={"judges": judges})
    # in config order
    assert result.per_reward == {"first_x": [1.0], "second_x": [1.0], "first_y": [1.0]}
    # one judge's rewards in order: its cache serves the later
    assert order.index(("a", "x")) < order.index(("a", "y"))


def test_check_specs_wants_each_judge_based_reward_s_judge_configured():
    default, named = RewardSpec("judge"), RewardSpec("judge", args={"judge": "second"})
    check_specs([default, named], judges=["judge", "second"])
    # no judge: section needed when none uses it
    check_specs([named, RewardSpec("json_valid")], judges=["second"])
    with pytest.raises(ValueError, match=r"needs a judge: add a `judge:` section.*or name one of "
                                         r"judges: \(second\) with args"):
        check_specs([default], judges=["second"])
    with pytest.raises(ValueError, match=r"args.judge='third' is not a configured judge; "
                                         r"configured: 'judge', 'second'"):
        check_specs([RewardSpec("judge", args={"judge": "third"})], judges=["judge", "second"])
    with pytest.raises(ValueError, match="needs a judge: add a `judge:` section"):
        check_specs([default], judges=[])
    # a mistyped name in an override (--judges.secnd.model=...) makes a judge that no reward calls
    with pytest.raises(ValueError,
                       match=r"judges.secnd is called by no reward .*did you mean judges.second\?"):
        check_specs([default, named], judges=["judge", "second", "secnd"])
    check_specs([RewardSpec("json_valid")], judges=["judge"])  # the judge: section may go unused
    with pytest.raises(ValueError, match="args.judge=3 must be the name of a judge"):
        check_specs([RewardSpec("judge", args={"judge": 3})], judges=["judge"])


def test_a_reward_taking_all_judges_uses_them_all_and_runs_nothing_at_once(monkeypatch):
    calls = []

    def either(completions, samples, *, judges):  # a custom reward that picks its judge itself
        calls.append(("either", threading.current_thread().name))
        return [judges["second"].score] * len(completions)

    def one(completions, samples, *, judge):
        calls.append((judge.score, threading.current_thread().name))
        return [judge.score] * len(completions)
    monkeypatch.setitem(REGISTRY, "test_either", (either, True))
    monkeypatch.setitem(REGISTRY, "test_one", (one, True))
    specs = [RewardSpec("test_either"), RewardSpec("test_one"),
             RewardSpec("test_one", args={"judge": "second"})]
    check_specs(specs[:1], judges=["judge", "second"])  # `judges` counts as calling every judge
    first, second = types.SimpleNamespace(score=1.0), types.SimpleNamespace(score=2.0)
    result = compute_rewards(["c"], [{}], specs,
                             context={"judge": first, "judges": {"judge": first, "second": second}})
    assert result.per_reward == {"test_either": [2.0], "test_one": [1.0], "test_one#2": [2.0]}
    # one thread: a Judge never shared
    assert {thread for _, thread in calls} == {threading.current_thread().name}


def test_a_raising_reward_gets_the_fallback_is_counted_and_logged_once(monkeypatch, caplog):
    def fragile(completion, sample):
        if completion == "boom":
            raise RuntimeError("parser exploded")
        return 1.0
    monkeypatch.setitem(REGISTRY, "test_fragile_1b7", (fragile, False))
    specs = [RewardSpec("test_fragile_1b7", fallback=-1.0), RewardSpec("json_valid", weight=0.0)]
    samples = [{"id": "sample-one"}, {"id": "sample-two"}, {"id": "x" * 10_000}]
    with caplog.at_level(logging.WARNING, logger="minigrpo.scoring"):
        first = compute_rewards(["boom", "fine", "boom"], samples, specs)
        second = compute_rewards(["boom", "boom", "fine"], samples, specs)
    assert first.per_reward["test_fragile_1b7"] == [-1.0, 1.0, -1.0] \
        and first.total == [-1.0, 1.0, -1.0]
    assert first.errors == {"test_fragile_1b7": 2, "json_valid": 0} \
        and second.errors["test_fragile_1b7"] == 2
    logged = [r for r in caplog.records if r.name == "minigrpo.scoring"]
    assert len(logged) == 1
    message = logged[0].getMessage()
    assert "test_fragile_1b7" in message and "parser exploded" in message \
        and "sample-one" in message
    assert len(message) < 2000  # the sample is truncated


@pytest.mark.parametrize("value", ["yes", float("nan"), float("inf"), [1.0], {"score": 1}])
def test_a_non_number_result_counts_as_an_error(monkeypatch, value):
    monkeypatch.setitem(REGISTRY, "test_bad_value", (lambda completion, sample: value, False))
    result = compute_rewards(["a", "b"], [{}, {}], [RewardSpec("test_bad_value", fallback=0.25)])
    assert result.per_reward["test_bad_value"] == [0.25, 0.25] \
        and result.errors["test_bad_value"] == 2


def test_bool_and_int_results_become_floats(monkeypatch):
    monkeypatch.setitem(REGISTRY, "test_bool",
                        (lambda completion, sample: completion == "y", False))
    monkeypatch.setitem(REGISTRY, "test_int", (lambda completion, sample: 2, False))
    result = compute_rewards(["y", "n"], [{}, {}],
                             [RewardSpec("test_bool"), RewardSpec("test_int")])
    assert result.per_reward == {"test_bool": [1.0, 0.0], "test_int": [2.0, 2.0]}
    assert all(type(v) is float for vs in result.per_reward.values() for v in vs)
    assert result.total == [3.0, 2.0] and result.errors == {"test_bool": 0, "test_int": 0}


def test_a_batched_reward_gets_whole_lists_and_fails_as_a_batch(monkeypatch):
    calls = []

    def batch(completions, samples, num_tokens, bonus=0.0):
        calls.append((list(completions), list(num_tokens)))
        return [len(c) + bonus if c != "skip" else None for c in completions]

    def broken(completions, samples):
        raise TimeoutError("judge timed out")
    monkeypatch.setitem(REGISTRY, "test_batch", (batch, True))
    monkeypatch.setitem(REGISTRY, "test_broken_batch", (broken, True))
    monkeypatch.setitem(REGISTRY, "test_short_batch", (lambda completions, samples: [1.0], True))
    specs = [RewardSpec("test_batch", args={"bonus": 1.0}),
             RewardSpec("test_broken_batch", fallback=-0.5),
             RewardSpec("test_short_batch", fallback=0.0)]
    result = compute_rewards(["ab", "skip", "abcd"], [{}, {}, {}], specs, num_tokens=[2, 1, 4])
    assert calls == [(["ab", "skip", "abcd"], [2, 1, 4])]
    assert result.per_reward["test_batch"] == [3.0, None, 5.0]
    assert result.per_reward["test_broken_batch"] == [-0.5, -0.5, -0.5]
    assert result.per_reward["test_short_batch"] == [0.0, 0.0, 0.0]
    # completions, not calls
    assert result.errors == {"test_batch": 0, "test_broken_batch": 3, "test_short_batch": 3}
    assert result.total == [2.5, -0.5, 4.5]


def test_a_misconfigured_spec_fails_loudly_instead_of_silently_scoring(monkeypatch):
    with pytest.raises(ValueError, match="unknown reward"):
        compute_rewards(["a"], [{}], [RewardSpec("nope")])
    # an arg the function accepts but rejects by value is only known per call: counted and logged
    result = compute_rewards(["{}"], [{}],
                             [RewardSpec("json_schema", args={"schema": {"a": {"bad": 1}}})])
    # skipped: the default fallback
    assert result.per_reward == {"json_schema": [None]} and result.errors == {"json_schema": 1}


def test_fallback_skip_leaves_a_failed_completion_unscored(monkeypatch):
    """fallback: skip gives a failed completion no value: its total is NaN (the trainer leaves it
    out of the advantages and the loss), it logs as missing, and a weight-0 entry never makes it
    NaN."""
    def shaky(completions, samples):
        # a judge that failed on "bad"
        return [math.nan if c == "bad" else 1.0 for c in completions]

    def down(completions, samples):
        raise ConnectionError("judge down")
    monkeypatch.setitem(REGISTRY, "test_shaky", (shaky, True))
    monkeypatch.setitem(REGISTRY, "test_down", (down, True))
    texts, samples = ["ok", "bad", "ok"], [{}] * 3
    res = compute_rewards(texts, samples,
                          [RewardSpec("test_shaky", fallback="skip"), RewardSpec("short_answer")])
    assert res.total[0] == 2.0 and math.isnan(res.total[1]) and res.total[2] == 2.0
    assert res.per_reward["test_shaky"] == [1.0, None, 1.0] and res.errors["test_shaky"] == 1
    logged = compute_rewards(texts, samples,
                             [RewardSpec("short_answer"),
                              RewardSpec("test_shaky", weight=0.0, fallback="skip")])
    assert logged.total == [1.0, 1.0, 1.0]
    down_res = compute_rewards(texts, samples, [RewardSpec("test_down", fallback="skip")])
    # one failed call: 3 completions
    assert all(math.isnan(t) for t in down_res.total) and down_res.errors["test_down"] == 3
    assert compute_rewards(texts, samples,
                           [RewardSpec("test_down", fallback=-1.0)]).total == [-1.0] * 3


def test_check_rows_knows_the_built_in_rewards_columns_and_only_the_ones_a_user_reward_declares(
        tmp_path):
    from config import ConfigError
    from scoring.checks import check_rows
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "q"}]  # a mixture: one source without gold
    check_rows([RewardSpec("answer_match")], rows)  # some row has the gold column: fine
    with pytest.raises(ConfigError, match="rewards: reward 'choice_accuracy': gold_key='cop' but "
                                          "no data row has"):
        check_rows([RewardSpec("choice_accuracy", args={"gold_key": "cop"})], rows)
    (tmp_path / "mine.py").write_text(
        # json_key reads the completion
        "def verdict(completion, sample, json_key='verdict'):\n    return 1.0\n"
        "def graded(completion, sample, label_key='label'):\n"
        "    return float(sample[label_key] == completion)\ngraded.row_keys = ('label_key',)\n")
    check_rows([RewardSpec(f"{tmp_path / 'mine.py'}:verdict")], rows)
    with pytest.raises(ConfigError,
                       match="label_key='label' but no held-out row has a column 'label'"):
        check_rows([RewardSpec(f"{tmp_path / 'mine.py'}:graded")], rows, "held-out")


@pytest.mark.parametrize("spec,message", [
    (RewardSpec("short_answer", args={"max_words": "two"}),
     "reward 'short_answer': args.max_words: expected int, got 'two'"),
    (RewardSpec("answer_match", args={"tolerance": [1, 2]}), "args.tolerance: expected float"),
    (RewardSpec("json_schema", args={"exact": "yes"}), "args.exact: expected bool"),
])
def test_reward_args_of_the_wrong_type_are_refused_before_the_run(spec, message):
    """Else the reward raises a TypeError on every completion and the run trains on its fallback."""
    with pytest.raises(ValueError, match=re.escape(message)):
        check_specs([spec])


def test_a_user_reward_that_cannot_take_completion_and_sample_is_refused(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def f():\n    return 1.0\n\ndef g(completion, sample, scale=1.0):\n"
                    "    return scale\n")
    with pytest.raises(ValueError, match=r"a reward takes \(completion, sample, \*\*args\)"):
        check_specs([RewardSpec(f"{path}:f")])
    # unannotated: anything goes, ints too
    check_specs([RewardSpec(f"{path}:g", args={"scale": 2})])


def test_annotations_the_config_checker_does_not_know_are_left_to_the_reward(tmp_path):
    """Path, Sequence, set, tuple: a user's reward gets the YAML value as before (no refusal, no
    crash)."""
    path = tmp_path / "mine.py"
    path.write_text("from pathlib import Path\nfrom typing import Sequence\n\n"
                    "def f(completion, sample, vocab: Path = Path('v'), words: Sequence[str] = (), "
                    "pair: tuple[int, int] = (0, 1), tags: set[str] = frozenset(), "
                    "n: int | None = None):\n    return 1.0\n")
    check_specs([RewardSpec(f"{path}:f", args={"vocab": "v.txt", "words": ["a"], "pair": [1, 2],
                                               "tags": ["x"], "n": 3})])
    with pytest.raises(ValueError, match="args.n: expected int"):
        check_specs([RewardSpec(f"{path}:f", args={"n": "three"})])


SEED_REWARDS = '''import json


def json_validity_reward(completions, **kwargs):
    rewards = []
    for completion in completions:
        try:
            json.loads(completion)
            rewards.append(1.0)
        except (json.JSONDecodeError, TypeError):
            rewards.append(0.0)
    return rewards


def accuracy_reward(completions, ground_truth, **kwargs):
    rewards = []
    for completion, gt in zip(completions, ground_truth):
        try:
            obj = json.loads(completion)
            rewards.append(1.0 if obj.get("predicted_category") == gt else 0.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def conversational(completions, **kwargs):
    return [float(c[0]["content"] == "x") for c in completions]


def seen(prompts, completions, completion_ids=None, **kwargs):
    """What TRL would pass, returned as one value a completion (None where it does not apply)."""
    assert (kwargs["subject"] == ["anatomy", "physiology"] and "prompt" not in kwargs
            and completion_ids is None)
    return [None if p == "skip me" else float(len(c)) for p, c in zip(prompts, completions)]


def needs_ids(completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def one_positional(completion, **kwargs):
    return 1.0
'''


def test_a_reward_function_written_for_trl_runs_unchanged_once_per_batch(tmp_path, caplog):
    """The MedMCQA project's own reward functions (its report, section 2.3): TRL's signature, called
    with the completions' text, so they score as their author meant (under TRL, with chat prompts,
    they got message lists and returned 0.0 throughout)."""
    from config import ConfigError
    from scoring.checks import check_rows
    path = tmp_path / "medmcqa_rewards.py"
    path.write_text(SEED_REWARDS)
    specs = [RewardSpec(f"{path}:json_validity_reward", label="valid"),
             RewardSpec(f"{path}:accuracy_reward", weight=2.0, label="acc")]
    check_specs(specs)
    rows = [{"prompt": [{"role": "user", "content": "Q1"}], "ground_truth": "B"},
            {"prompt": [{"role": "user", "content": "Q2"}], "ground_truth": "C"}]
    check_rows(specs, rows)
    right, wrong, broken = '{"predicted_category": "B"}', \
        '{"predicted_category": "A"}', "The answer is C"
    result = compute_rewards([right, wrong, broken], [rows[0], rows[1], rows[1]], specs)
    assert result.total == [3.0, 1.0, 0.0]
    assert result.errors == {"valid": 0, "acc": 0} and result.per_reward["acc"] == [1.0, 0.0, 0.0]

    with pytest.raises(ConfigError, match="reads the column 'ground_truth'.*which no data row has"):
        check_rows(specs, [{"prompt": "Q", "answer": "B"}])
    other = [{"prompt": "p", "subject": "anatomy"}, {"prompt": "skip me", "subject": "physiology"}]
    assert compute_rewards(["abc", "de"], other,
                           [RewardSpec(f"{path}:seen", label="s")]).per_reward["s"] == [3.0, None]
    with pytest.raises(ValueError, match="needs completion_ids, which minigrpo does not pass"):
        check_specs([RewardSpec(f"{path}:needs_ids")])
    with pytest.raises(ValueError, match=r"a reward takes \(completion, sample, \*\*args\)"):
        # neither minigrpo's nor TRL's: refused, not 0.0 throughout
        check_specs([RewardSpec(f"{path}:one_positional")])
    with caplog.at_level(logging.WARNING, logger="minigrpo.scoring"):
        out = compute_rewards(["x"], [rows[0]], [RewardSpec(f"{path}:conversational", label="c")])
    assert out.errors == {"c": 1}
    assert any(
        "completions are passed as text here, not as lists of {role, content}" in r.getMessage()
        for r in caplog.records)


TRL_RETURNS = '''import asyncio
import dataclasses

import numpy as np


# a configured reward object, as TRL's own reward helpers are: unhashable (eq without frozen)
@dataclasses.dataclass
class LengthOver:
    n: int

    def __call__(self, completions, **kwargs):
        return [float(len(c) > self.n) for c in completions]


over_two = LengthOver(2)


async def awaited(completions, **kwargs):  # TRL awaits an async reward function
    return [float(len(c)) for c in completions]


# waits on the reward loop from inside it: refused, not a hang
async def nested(completions, **kwargs):
    from sources import plugins

    async def inner():
        return 1.0
    return [plugins.on_reward_loop(inner()) for _ in completions]


# state kept between calls, bound to the loop it first waits on (as a client's pool is)
_event = asyncio.Event()


async def keeps_state(completions, **kwargs):
    asyncio.get_running_loop().call_soon(_event.set)
    # on another loop than the first call's: "is bound to a different event loop"
    await _event.wait()
    _event.clear()
    return [1.0 for _ in completions]


# TRL never passes `prompt`: refused before the run, not 0.0 throughout
def singular(completions, prompt, **kwargs):
    return [0.0] * len(completions)


def as_array(completions, **kwargs):
    return np.array([float(len(c)) for c in completions])


def as_generator(completions, **kwargs):
    return (float(len(c)) for c in completions)


def as_numpy_bools(completions, **kwargs):
    return [np.bool_(len(c) > 2) for c in completions]
'''


def test_a_trl_reward_may_return_what_trl_takes_an_array_a_generator_numpy_scalars(tmp_path):
    """TRL iterates whatever a reward function returns ([r if r is not None else nan for r in out]):
    a numpy array, a generator, numpy bools all score there; here they scored the fallback, 0.0, on
    every completion of every batch, with one warning."""
    path = tmp_path / "trl_returns.py"
    path.write_text(TRL_RETURNS)
    rows = [{"prompt": "p"}, {"prompt": "q"}]
    for name, want in [("as_array", [3.0, 2.0]), ("as_generator", [3.0, 2.0]),
                       ("as_numpy_bools", [1.0, 0.0]), ("over_two", [1.0, 0.0]),
                       ("awaited", [3.0, 2.0])]:
        res = compute_rewards(["abc", "de"], rows, [RewardSpec(f"{path}:{name}", label=name)])
        assert (res.per_reward[name], res.errors[name]) == (want, 0), name
    res = compute_rewards(["abc", "de"], rows, [RewardSpec(f"{path}:nested", label="n")])
    assert res.errors["n"] == 2 and res.per_reward["n"] == [None, None]  # skipped, at once
    for step in range(3):
        # one event loop for the run, as TRL's: state kept between steps still works
        res = compute_rewards(["abc", "de"], rows, [RewardSpec(f"{path}:keeps_state", label="k")])
        assert (res.per_reward["k"], res.errors["k"]) == ([1.0, 1.0], 0), step
    with pytest.raises(ValueError, match="takes 'prompt', which neither TRL nor minigrpo passes; "
                                         "take 'prompts'"):
        check_specs([RewardSpec(f"{path}:singular")])


def test_a_trl_reward_reading_a_column_that_only_some_rows_have_runs_on_a_mixture(tmp_path):
    """A mixture of a source with gold and one without (GRubrics' verifiable and open questions):
    the function gets None for the rows without it, as README says ("a column the function needs and
    no row has stops the run"); it was refused at the first row lacking it."""
    from config import ConfigError
    from scoring.checks import check_rows
    path = tmp_path / "gold.py"
    path.write_text("def acc(completions, ground_truth, **kwargs):\n    return [None if g is None "
                    "else float(g in c) for c, g in zip(completions, ground_truth)]\n")
    specs = [RewardSpec(f"{path}:acc", label="acc")]
    rows = [{"prompt": "a", "ground_truth": "x"}, {"prompt": "b", "rubric": "r"}]
    check_rows(specs, rows)
    assert compute_rewards(["x", "x"], rows, specs).per_reward["acc"] == [1.0, None]
    with pytest.raises(ConfigError, match="reads the column 'ground_truth'.*which no data row has"):
        check_rows(specs, [{"prompt": "b", "rubric": "r"}])
