"""Rewards for a model that answers in JSON (the MedMCQA classifier): the reply is valid JSON, it
follows a schema, the letter it picks is the gold one. Registered by name, as every reward:

    rewards:
      - {name: json_valid}
      - {name: json_schema, args: {schema: {predicted_category: {enum: [A, B, C, D]}}}}
      - {name: choice_accuracy, weight: 2.0, args: {gold_key: cop}}

rewards.lookup imports this module the first time a config names one of them.
"""
from __future__ import annotations

import math
from typing import Any

import answers
from rewards import register

MEDMCQA_SCHEMA = {
    "predicted_category": {"enum": ["A", "B", "C", "D"]},
    "confidence": {"type": "number", "min": 0, "max": 1},
    "reason": {"type": "string", "min_length": 1},
}
_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool,
          "object": dict, "array": list, "null": type(None)}
_RULES = {"type", "enum", "min", "max", "min_length", "max_length"}


@register("json_valid")
def json_valid(completion: str, sample: dict, allow_fence: bool = False, strip_think: bool = True,
               require_object: bool = True, assistant_prefix: str = "") -> float:
    r"""1.0 if the whole answer is one JSON object, else 0.0.

    The answer is the completion without surrounding whitespace and, with strip_think, without a
    leading <think>...</think> block (an unclosed one leaves no answer). Prose around the JSON,
    NaN/Infinity and duplicate keys fail: MedMCQA asks for "exactly this JSON, nothing else".
    allow_fence: also accept the answer wrapped in a ```json (or bare ```) fence.
    require_object: only an object counts (MedMCQA); False accepts any JSON value.

    >>> (json_valid('{"a": {"b": [1, 2]}}', {}), json_valid('Sure! {"a": 1}', {}),
    ...  json_valid('{"a": 1} ok', {}))
    (1.0, 0.0, 0.0)
    >>> (json_valid('```json\n{"a": 1}\n```', {}),
    ...  json_valid('```json\n{"a": 1}\n```', {}, allow_fence=True))
    (0.0, 1.0)
    >>> (json_valid('<think>easy</think> {"a": 1}', {}), json_valid('[1, 2]', {}),
    ...  json_valid('[1]', {}, require_object=False))
    (1.0, 0.0, 1.0)
    """
    ok, value = answers.parse_json(assistant_prefix + completion, allow_fence, strip_think)
    return float(ok and (isinstance(value, dict) or not require_object))


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("number", "integer"):
        return False  # True is an int to Python, not a number to JSON
    if isinstance(value, float) and not math.isfinite(value):
        return False  # 1e999 parses to inf
    return isinstance(value, _TYPES[name])


def _follows(value: Any, rule: dict) -> bool:
    if "type" in rule and not _is_type(value, rule["type"]):
        return False
    # type-exact, so that true does not pass as 1 and 1.0 not as 1
    if "enum" in rule and not any(type(value) is type(e) and value == e for e in rule["enum"]):
        return False
    if ("min" in rule or "max" in rule) and not (
            _is_type(value, "number")
            and rule.get("min", -math.inf) <= value <= rule.get("max", math.inf)):
        return False
    if "min_length" in rule or "max_length" in rule:
        if not isinstance(value, (str, list)):
            return False
        size = len(value.strip()) if isinstance(value, str) else len(value)  # "   " is empty
        return rule.get("min_length", 0) <= size <= rule.get("max_length", math.inf)
    return True


@register("json_schema")
def json_schema(completion: str, sample: dict, schema: dict | None = None, exact: bool = True,
                allow_fence: bool = False, strip_think: bool = True,
                assistant_prefix: str = "") -> float:
    r"""1.0 if the answer is a JSON object whose keys follow `schema`, else 0.0.

    schema: {key: rule}, default MEDMCQA_SCHEMA. A rule may hold: type (string, number,
    integer, boolean, object, array, null; number and integer exclude booleans and inf),
    enum (a list; matched with equal type), min/max (numbers, inclusive), min_length/max_length
    (strings, counted after stripping whitespace, or arrays). {} accepts any value.
    exact: the keys must be exactly the schema's (the format the seed's prompt asks for); False
    allows extra keys, as the seed's own schema_compliance_reward did.
    allow_fence, strip_think: as in json_valid.

    >>> good = '{"predicted_category": "B", "confidence": 0.9, "reason": "B12 is in meat"}'
    >>> (json_schema(good, {}), json_schema(good.replace("0.9", "true"), {}),
    ...  json_schema(good.replace('"B"', '"E"'), {}))
    (1.0, 0.0, 0.0)
    >>> json_schema('{"answer": 3, "note": ""}', {}, schema={"answer": {"type": "integer"}},
    ...             exact=False)
    1.0
    """
    schema = MEDMCQA_SCHEMA if schema is None else schema
    for key, rule in schema.items():  # a broken schema is a config error, even if the JSON fails
        if unknown := set(rule or {}) - _RULES:
            raise ValueError(f"schema rule for {key!r} has unknown fields {sorted(unknown)}; "
                             f"use {sorted(_RULES)}")
        if (rule or {}).get("type", "string") not in _TYPES:
            raise ValueError(f"schema type {rule['type']!r} for {key!r} is not one of "
                             f"{sorted(_TYPES)}")
    ok, obj = answers.parse_json(assistant_prefix + completion, allow_fence, strip_think)
    if (not ok or not isinstance(obj, dict) or not set(schema) <= set(obj)
            or (exact and set(obj) != set(schema))):
        return 0.0
    return float(all(_follows(obj[key], rule or {}) for key, rule in schema.items()))


def _gold_letter(gold: Any, letters: list[str]) -> str:
    if isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(letters):
        return letters[gold]  # MedMCQA's cop: a 0-based index
    if isinstance(gold, str) and gold.strip().upper() in letters:
        return gold.strip().upper()
    raise ValueError(f"gold answer {gold!r} is neither one of {letters} "
                     f"nor an index 0-{len(letters) - 1}")


@register("choice_accuracy", row_keys=("gold_key",))
def choice_accuracy(completion: str, sample: dict, gold_key: str = "answer",
                    field: str = "predicted_category", letters: str = "ABCD",
                    fallback_pattern: str | None = None, allow_fence: bool = False,
                    strip_think: bool = True, assistant_prefix: str = "") -> float | None:
    r"""1.0 if the predicted letter equals the sample's gold letter, else 0.0; None without gold.

    The prediction is the string `field` of the JSON answer, stripped and upper-cased ("b " is
    B; the number 1 is not). Only when the answer is not JSON, and fallback_pattern is set, the
    last match of that regex (its first group) is the prediction, e.g. r"Answer:\s*([A-D])".
    The gold sample[gold_key] is a letter (any case) or a 0-based index (MedMCQA's `cop`).

    >>> choice_accuracy('{"predicted_category": "b"}', {"cop": 1}, gold_key="cop")
    1.0
    >>> (choice_accuracy('Answer: B', {"answer": "B"}),
    ...  choice_accuracy('Answer: B', {"answer": "B"}, fallback_pattern=r"Answer:\s*([A-D])"))
    (0.0, 1.0)
    >>> print(choice_accuracy('{"predicted_category": "B"}', {}))
    None
    """
    if sample.get(gold_key) is None:
        return None
    letters = [letter.upper() for letter in letters]
    gold = _gold_letter(sample[gold_key], letters)
    completion = assistant_prefix + completion
    ok, obj = answers.parse_json(completion, allow_fence, strip_think)
    if ok:
        pred = obj.get(field) if isinstance(obj, dict) else None
    elif fallback_pattern:
        found = answers.find_all(fallback_pattern,
                                 answers.answer_part(completion) if strip_think else completion)
        pred = found[-1] if found else None
    else:
        pred = None
    return float(isinstance(pred, str) and pred.strip().upper() == gold)
