r"""Rewards: plain functions in a registry, run over completions (scoring/batch.py) with weights.

A reward scores one completion of one sample; None means "does not apply to this sample":

    def my_reward(completion: str, sample: dict, **args) -> float | None

A batched reward (LLM judges, see judge.py; people's ratings, graders/ratings.py) takes and returns
lists and is registered with `@register("name", batched=True)`. A reward may carry a
`check_args(**args)` attribute that raises ValueError on bad values: scoring.check_specs calls it
before any model loads; an `open(**args)` attribute that acquires what it needs (reward_model loads
its model) when train.py or eval.py open their rewards, ValueError when it cannot; and a `row_keys`
attribute (or `register(..., row_keys=...)`) naming its arguments that hold a data column, as the
built-ins' gold_key and valid_key do: a column no row has stops the run before it starts
(scoring.check_rows). The config names rewards, weights and arguments:

    rewards:
      - {name: json_valid}
      - {name: choice_accuracy, weight: 2.0, args: {gold_key: cop}}
      - {name: my_rewards.py:no_hedging, weight: 0.5}      # a function in a file
      - {name: mypkg.rewards:brevity}                       # a function in an importable module

    total_i = sum_k weight_k * r_k(completion_i, sample_i)    (a None r_k adds 0)

Parameters after (completion, sample) named `num_tokens` (the completion's token count),
`assistant_prefix` (the text the trainer forced at the start of the reply, which the built-ins put
back in front), `judge` or `judges` are filled in by scoring.compute_rewards; a function named by
file or module is loaded by sources/plugins.py, which also runs reward functions written for
TRL's GRPOTrainer. Model output is only ever parsed (here, scoring/answers.py,
graders/citations.py), never evaluated.
"""
from __future__ import annotations

import importlib
from fractions import Fraction
from typing import Callable

from scoring import answers

REGISTRY: dict[str, tuple[Callable, bool]] = {}  # name -> (function, batched)
def register(name: str, batched: bool = False, row_keys: tuple[str, ...] = ()):
    """Decorator that makes a reward available to configs under `name`; row_keys: its arguments that
    name a data column (scoring.check_rows checks the rows have it)."""
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


# ---------------------------------------------------- rewards in other files, registered when named
# The judge's rewards (judge.py) and the graders (graders/) register themselves when their module is
# imported; lookup imports it the first time a config names one, so the core never imports graders/
# (`import train` loads no rating page).
ELSEWHERE = {"json_valid": "graders.json_answers", "json_schema": "graders.json_answers",
             "choice_accuracy": "graders.json_answers", "human": "graders.ratings",
             "judge": "judge", "rubric_alignment": "judge", "reward_model": "graders.reward_model",
             "citation_grounding": "graders.citations", "invented_citation": "graders.citations",
             "citation_pass": "graders.citations", "env_reward": "episodes"}


def lookup(name: str) -> tuple[Callable, bool] | None:
    """The (function, batched) registered under `name`, its module imported first if need be."""
    if name not in REGISTRY and name in ELSEWHERE:
        importlib.import_module(ELSEWHERE[name])
    return REGISTRY.get(name)


def names() -> list[str]:
    """Every name a config may give a reward by: registered, or registered when first looked up."""
    return sorted(set(REGISTRY) | set(ELSEWHERE))
