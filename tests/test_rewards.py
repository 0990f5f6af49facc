"""Tests for rewards.py: every built-in on good, bad and adversarial completions, then the
registry and loading user functions (check_specs and compute_rewards: test_scoring.py).

    python -m pytest --doctest-modules rewards.py tests/test_rewards.py
"""
import json
import time

import pytest

import rewards
from config import RewardSpec
from graders.citations import citation_grounding, invented_citation
from graders.json_answers import choice_accuracy, json_schema, json_valid
from rewards import (
    REGISTRY,
    answer_match,
    length_penalty,
    register,
    resolve,
    short_answer,
    think_format,
)

GOOD = '{"predicted_category": "B", "confidence": 0.9, "reason": "B12 is only in animal foods"}'
BUILTINS = {"json_valid", "json_schema", "choice_accuracy", "answer_match", "think_format",
            "invented_citation", "citation_grounding", "length_penalty", "short_answer"}


# ---------------------------------------------------------------- json_valid

@pytest.mark.parametrize("completion", [
    GOOD, "  \n" + GOOD + "\n ", '{"a": {"b": {"c": [1, {"d": "}"}]}}}', "{}",
    "<think>Let me think {not json</think>\n" + GOOD,
])
def test_json_valid_accepts_one_json_object(completion):
    assert json_valid(completion, {}) == 1.0


@pytest.mark.parametrize("completion", [
    "", "   ", "B", GOOD + " I hope this helps!", "Here is my answer: " + GOOD, GOOD + GOOD,
    "{'predicted_category': 'B'}",            # Python dict, not JSON
    '{"a": 1,}',                              # trailing comma
    '{"a": NaN}', '{"a": Infinity}',          # Python's json accepts these, JSON does not
    '{"a": 1, "a": 2}',                       # duplicate keys are ambiguous
    '{"a": ' + "9" * 5000 + "}",              # more digits than int() accepts
    "[" * 100_000 + "]" * 100_000,           # nesting deeper than the recursion limit
    '{"a": 1',                                # cut off
    "<think>" + GOOD,                         # unclosed think: the JSON is still reasoning
    "[1, 2]", '"text"', "null", "3",         # JSON, but not an object
])
def test_json_valid_rejects_everything_but_one_json_object(completion):
    assert json_valid(completion, {}) == 0.0


def test_json_valid_accepts_fences_only_when_allowed_and_only_as_the_whole_answer():
    fenced, bare = "```json\n" + GOOD + "\n```", "```\n" + GOOD + "\n```"
    assert (json_valid(fenced, {}), json_valid(bare, {})) == (0.0, 0.0)
    assert json_valid(fenced, {}, allow_fence=True) == json_valid(bare, {}, allow_fence=True) == 1.0
    assert json_valid("```JSON " + GOOD + "```", {}, allow_fence=True) == 1.0
    assert json_valid("Sure:\n" + fenced, {}, allow_fence=True) == 0.0
    assert json_valid(fenced + "\nDone.", {}, allow_fence=True) == 0.0
    assert json_valid("```python\n" + GOOD + "\n```", {}, allow_fence=True) == 0.0
    assert json_valid(fenced + "\n" + fenced, {}, allow_fence=True) == 0.0
    assert json_valid("<think>plan</think>\n" + fenced, {}, allow_fence=True) == 1.0


def test_json_valid_options_for_think_and_non_objects():
    assert json_valid("<think>ok</think>" + GOOD, {}, strip_think=False) == 0.0
    assert json_valid("[1, 2]", {}, require_object=False) == 1.0
    assert json_valid("null", {}, require_object=False) == 1.0
    assert json_valid("[1, 2] and more", {}, require_object=False) == 0.0


def test_a_think_close_that_closes_nothing_hides_nothing():
    """Free reasoning before a stray </think> would pass as a JSON-only or a short answer; a think
    block the forced prefix (or the template, through rollout.reply_prefix) opened still counts."""
    reasoning = "I'm unsure, maybe A or C. Let me compute 67 + 5 carefully: it is 72 here.</think>"
    assert json_valid(reasoning + GOOD, {}) == 0.0
    assert choice_accuracy(reasoning + GOOD, {"answer": "B"}) == 0.0
    assert short_answer(reasoning + "72", {}, max_words=4) == 0.0
    # the last number is still the answer
    assert answer_match(reasoning + "72", {"answer": 72}) == 1.0
    assert json_valid(reasoning + GOOD, {}, assistant_prefix="<think>") == 1.0
    assert short_answer(reasoning + "72", {}, max_words=4, assistant_prefix="<think>\n") == 1.0


# ---------------------------------------------------------------- json_schema

def _medmcqa(**changes):
    obj = {"predicted_category": "B", "confidence": 0.9, "reason": "B12 is only in animal foods"}
    obj.update(changes)
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


@pytest.mark.parametrize("completion", [
    GOOD, _medmcqa(confidence=0), _medmcqa(confidence=1), _medmcqa(confidence=1.0),
    _medmcqa(predicted_category="D"), "<think>B12 comes from animals</think>" + GOOD,
])
def test_json_schema_accepts_the_medmcqa_answer(completion):
    assert json_schema(completion, {}) == 1.0


@pytest.mark.parametrize("completion", [
    _medmcqa(confidence=True), _medmcqa(confidence="0.9"), _medmcqa(confidence=1.5),
    _medmcqa(confidence=-0.1),
    _medmcqa(confidence=None), GOOD.replace("0.9", "1e999"),  # parses to inf
    _medmcqa(predicted_category="E"), _medmcqa(predicted_category="b"),
    _medmcqa(predicted_category="AB"), _medmcqa(predicted_category=1),
    _medmcqa(predicted_category=["B"]), _medmcqa(predicted_category=" B"),
    _medmcqa(reason=""), _medmcqa(reason="   \n"), _medmcqa(reason=5), _medmcqa(reason=["x"]),
    _medmcqa(reason=...), _medmcqa(confidence=...),           # missing key
    # extra key: the seed wants exactly three
    _medmcqa(extra="x"),
    "[" + GOOD + "]", GOOD + " trailing", "Answer: " + GOOD, "{}",
])
def test_json_schema_rejects_wrong_types_values_and_keys(completion):
    assert json_schema(completion, {}) == 0.0


def test_json_schema_is_configurable():
    schema = {"answer": {"type": "integer", "min": 0}, "steps": {"type": "array", "min_length": 1},
              "note": {}}
    assert json_schema('{"answer": 3, "steps": ["x"], "note": null}', {}, schema=schema) == 1.0
    # 3.0 is no integer
    assert json_schema('{"answer": 3.0, "steps": ["x"], "note": 1}', {}, schema=schema) == 0.0
    assert json_schema('{"answer": true, "steps": ["x"], "note": 1}', {}, schema=schema) == 0.0
    assert json_schema('{"answer": -1, "steps": ["x"], "note": 1}', {}, schema=schema) == 0.0
    assert json_schema('{"answer": 3, "steps": [], "note": 1}', {}, schema=schema) == 0.0
    # note is required
    assert json_schema('{"answer": 3, "steps": ["x"]}', {}, schema=schema) == 0.0
    assert json_schema(_medmcqa(extra="x"), {}, exact=False) == 1.0
    # enum matches type too
    assert json_schema('{"ok": 1}', {}, schema={"ok": {"enum": [True]}}) == 0.0
    assert json_schema('{"ok": true}', {}, schema={"ok": {"enum": [True]}}) == 1.0
    assert json_schema('{"s": "abcd"}', {},
                       schema={"s": {"type": "string", "max_length": 3}}) == 0.0


def test_json_schema_rejects_a_broken_schema_even_when_the_answer_is_not_json():
    with pytest.raises(ValueError, match="minimum"):
        json_schema("not json", {}, schema={"a": {"minimum": 0}})
    with pytest.raises(ValueError, match="float"):
        json_schema(GOOD, {}, schema={"a": {"type": "float"}})


# ---------------------------------------------------------------- choice_accuracy

def _pred(letter):
    return _medmcqa(predicted_category=letter)


def test_choice_accuracy_compares_the_json_field_with_a_letter_or_an_index_gold():
    assert choice_accuracy(_pred("B"), {"answer": "B"}) == 1.0
    assert choice_accuracy(_pred("C"), {"answer": "B"}) == 0.0
    assert choice_accuracy(_pred("B"), {"cop": 1}, gold_key="cop") == 1.0
    assert choice_accuracy(_pred("A"), {"cop": 0}, gold_key="cop") == 1.0
    assert choice_accuracy(_pred("B"), {"cop": 0}, gold_key="cop") == 0.0
    assert choice_accuracy(_pred("D"), {"answer": " d "}) == 1.0
    # case and spaces are format, not accuracy
    assert choice_accuracy(_pred(" b "), {"answer": "B"}) == 1.0
    assert choice_accuracy('{"letter": "B"}', {"answer": "B"}, field="letter") == 1.0
    assert choice_accuracy("<think>not A</think>" + _pred("B"), {"answer": "B"}) == 1.0


@pytest.mark.parametrize("completion", [
    _pred("E"), _pred("BC"), _pred("B)"), _pred(1), _pred(None), _pred(["B"]), '{"answer": "B"}',
    "B",
    "The answer is B: " + _pred("B"),        # JSON in prose does not parse, and no fallback is set
    "<think>" + _pred("B"),                   # unclosed think
    '["B"]',
])
def test_choice_accuracy_gives_nothing_for_a_prediction_it_cannot_read(completion):
    assert choice_accuracy(completion, {"answer": "B"}) == 0.0


def test_choice_accuracy_fallback_pattern_only_applies_when_the_answer_is_not_json():
    pattern = r"Answer:\s*([A-D])"
    assert choice_accuracy("Answer: B", {"answer": "B"}) == 0.0
    assert choice_accuracy("Answer: B", {"answer": "B"}, fallback_pattern=pattern) == 1.0
    assert choice_accuracy("Answer: A ... no wait, Answer: B", {"answer": "B"},
                           fallback_pattern=pattern) == 1.0
    assert choice_accuracy("Answer: B then Answer: A", {"answer": "B"},
                           fallback_pattern=pattern) == 0.0
    assert choice_accuracy("Answer: E", {"answer": "B"}, fallback_pattern=pattern) == 0.0
    # JSON plus text is not JSON: the fallback reads the text, and only one answer counts
    assert choice_accuracy(_pred("C") + " Answer: B", {"answer": "B"},
                           fallback_pattern=pattern) == 1.0
    assert choice_accuracy(_pred("B") + " Answer: C", {"answer": "B"},
                           fallback_pattern=pattern) == 0.0
    assert choice_accuracy('{"predicted_category": "C"}', {"answer": "B"},
                           fallback_pattern=r'"([A-D])"') == 0.0
    assert choice_accuracy("<think>Answer: B</think>Answer: C", {"answer": "B"},
                           fallback_pattern=pattern) == 0.0


def test_choice_accuracy_is_none_without_gold_and_raises_on_unreadable_gold():
    assert choice_accuracy(_pred("B"), {}) is None
    assert choice_accuracy(_pred("B"), {"answer": None}) is None
    for gold in (4, -1, True, "E", "", "1", 1.0):
        with pytest.raises(ValueError, match="gold"):
            choice_accuracy(_pred("B"), {"answer": gold})
    assert choice_accuracy(_pred("E"), {"answer": 4}, letters="ABCDE") == 1.0


# ---------------------------------------------------------------- answer_match

@pytest.mark.parametrize("completion, gold", [
    ("She has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", 18),
    ("#### 1,000", 1000), ("####72", 72), ("#### $1,234,567.00", "1234567"),
    ("#### 72\nThe answer is 70 (just kidding).", 72),  # the marker beats later numbers
    ("#### 72 (that is 8 * 9)", 72),                      # inside a marker the first number counts
    ("so x = 3 \\boxed{72}", 72), ("\\boxed{\\frac{1}{2}}", 0.5), ("\\boxed{\\dfrac{3}{4}}", 0.75),
    ("\\boxed{\\text{\\$}1{,}000}", 1000), ("\\boxed{{72}}", 72), ("\\boxed{-5}", -5),
    ("<answer> 72 </answer>", 72), ("<answer>72</answer> then <answer>5", 72),
    ("<answer>5</answer> \\boxed{72}", 72), ("\\boxed{5} ... #### 72", 72),
    ("The answer is 72.", 72), ("It costs $72.00", 72), ("3.0", 3), ("3", 3.0), ("x = -4", -4),
    ("10 - 3 = 7", 7), ("3/4 of them", 0.75), ("That is 50%", 50), ("1, 2, 3", 3), ("0.1", 0.1),
    ("<think>maybe 70? 3 + 4...</think>It is 72", 72),
    ("1000000000000000000000000", "#### 1000000000000000000000000"),
    # Markdown headings are not markers
    ("#### Final Answer\n\\boxed{72}", 72), ("#### Step 1: add\n48 + 24 = 72", 72),
    ("##### 3 steps\nso 72", 72), ("#### \u22125", -5), ("#### -$5", -5), ("#### .5", 0.5),
    ("so 0.5", ".5"),
    ("Prices range from $10 - $15", 15), ("- $5 for pens", 5), ("#### Answer: 72", 72),
    # an answer line, text below
    ("#### Answer: 72\nBecause 8 * 9 = 72, over 3 days.", 72),
])
def test_answer_match_reads_the_final_number(completion, gold):
    assert answer_match(completion, {"answer": gold}) == 1.0


@pytest.mark.parametrize("completion, gold", [
    ("", 72), ("I don't know", 72), ("#### ", 72), ("#### seventy-two", 72), ("\\boxed{}", 72),
    ("72 minus 2 is 70", 72),                          # last number, not any number
    ("Janet has 16 eggs and eats 3.", 16),             # echoing the question is not answering
    ("\\boxed{72} no wait #### 70", 72),               # #### has priority over \boxed
    ("10-3", -3), ("1,000", 1), ("1,0000", 1000), ("12,34", 12.34), ("7.2", 72), ("72", 73),
    ("-72", 72),
    ("1000000000000000000000001", 10**24),             # equal as floats, not as numbers
    ("9" * 5000, 72), ("72 then " + "9" * 5000, 72),   # no fallback to an earlier number
    ("1/0", 72), ("x2 = 72y", 2),
    ("<think>the answer is 72", 72),                   # truncated reasoning holds no answer
    ("<think>the answer is 72</think>I give up", 72),
    ("<think>ok</think>72</think>70", 72),             # the answer follows the last </think>
    ("#### Step 2: add\n48 + 24 = 72\n\\boxed{72}", 2),  # a heading's number is not the answer
])
def test_answer_match_rejects_a_wrong_or_missing_number(completion, gold):
    assert answer_match(completion, {"answer": gold}) == 0.0


def test_answer_match_mode_tolerance_and_think():
    assert answer_match("72 apples minus 2", {"answer": 72}, mode="first") == 1.0
    assert answer_match("72 apples minus 2", {"answer": 72}, mode="last") == 0.0
    assert answer_match("0.33333", {"answer": "1/3"}) == 0.0
    assert answer_match("0.333333", {"answer": "1/3"}) == 1.0  # within 1e-6
    assert answer_match("0.333", {"answer": "1/3"}, tolerance=1e-3) == 1.0
    assert answer_match("<think>x</think>72", {"answer": 72}, strip_think=False) == 1.0
    assert answer_match("<think>the answer is 72", {"answer": 72}, strip_think=False) == 1.0
    with pytest.raises(ValueError, match="mode"):
        answer_match("72", {"answer": 72}, mode="middle")


def test_parsing_stays_linear_on_degenerate_repetitive_output():
    start = time.perf_counter()
    for text in ("<answer>" * 20_000 + "7", "\\boxed{" * 20_000, "```" * 20_000, "1," * 50_000,
                 "-" * 100_000 + "7"):
        answer_match(text, {"answer": 7}), json_schema(text, {}, allow_fence=True), \
            short_answer(text, {})
    for text in ("PMID" + " " * 20_000 + "x", "PMID: 12345" + " " * 20_000 + "x",
                 "PMID: 12345 " * 5_000):
        # helper-47: runs of blanks were quadratic
        citation_grounding(text, {"valid_pmids": ["12345"]})
    assert time.perf_counter() - start < 2.0  # a quadratic regex takes minutes here


def test_answer_match_is_none_without_gold_and_raises_on_unreadable_gold():
    assert answer_match("72", {}) is None
    assert answer_match("72", {"answer": None}) is None
    assert answer_match("72", {"answer": 72}, gold_key="solution") is None
    with pytest.raises(ValueError, match="no number"):
        answer_match("72", {"answer": "seventy-two"})
    for gold in (True, [72], float("nan")):
        with pytest.raises((TypeError, ValueError)):
            answer_match("72", {"answer": gold})


# ---------------------------------------------------------------- think_format

@pytest.mark.parametrize("completion, kwargs", [
    ("<think>Vitamin B12 comes from animals.</think>\nB", {}),
    ("  \n<think>\nlong enough reasoning\n</think>\n\nThe answer is B.", {}),
    ("long enough reasoning</think>B", {"assistant_prefix": "<think>"}),
    ("<think>long enough reasoning</think>", {"require_answer": False}),
    ("<think>hi</think>B", {"min_think_chars": 2}),
    ("<think></think>B", {"min_think_chars": 0}),
])
def test_think_format_accepts_one_leading_think_block_then_an_answer(completion, kwargs):
    assert think_format(completion, {}, **kwargs) == 1.0


@pytest.mark.parametrize("completion, kwargs", [
    ("B", {}), ("", {}),
    # empty or trivial
    ("<think></think>B", {}), ("<think>          \n   </think>B", {}), ("<think>hi</think>B", {}),
    # no answer
    ("<think>long enough reasoning</think>", {}), ("<think>long enough reasoning</think>  \n ", {}),
    ("<think>long enough reasoning", {}),                                              # unclosed
    ("<think>long enough <think>nested</think> reasoning</think>B", {}),             # nested
    ("<think>long enough reasoning</think>B<think>second thoughts!</think>C", {}),   # repeated
    ("<think>long enough reasoning</think>B</think>", {}),                          # stray close
    ("Sure. <think>long enough reasoning</think>B", {}),                             # not leading
    # opening tag missing
    ("long enough reasoning</think>B", {}),
    # prefix + model's own tag
    ("<think>long enough reasoning</think>B", {"assistant_prefix": "<think>"}),
    ("</think>long enough reasoning<think>B", {}),
    ("<THINK>long enough reasoning</THINK>B", {}),
])
def test_think_format_rejects_missing_empty_nested_repeated_or_unclosed_blocks(completion, kwargs):
    assert think_format(completion, {}, **kwargs) == 0.0


# ---------------------------------------------------------------- citation_grounding

SOURCES = {"valid_pmids": ["12345", 67890, " 555 "]}


@pytest.mark.parametrize("completion, expected", [
    ("Shown in PMID: 12345.", 1.0),
    ("PMID:12345 and PMID 67890 and [PMID: 555]", 3.0),
    ("PMID: 99999", -2.0),                                   # invented
    ("PMID: 12345, PMID: 99999", -1.0),
    ("PMID: 12345 PMID: 12345 PMID: 12345", 1.0),            # repeating a valid id earns nothing
    ("PMID: 99999 PMID: 99999", -2.0),                       # nor costs more
    ("PMID: 123456", -2.0), ("PMID: 1234", -2.0),            # near misses are invented
    ("pmid 12345 and Pmid: 99999", -1.0),                    # case does not hide an invention
    ("<think>PMID: 99999</think>PMID: 12345", -1.0),         # inventions in the reasoning count
    ("No citations here, 12345 is just a number.", 0.0),
    # an invention listed after a valid id counts
    ("PMID: 12345, 99999", -1.0),
    ("[PMID: 12345; 99999]", -1.0), ("PMIDs: 99999, 99998", -4.0),
    ("(PMID 12345, 67890 & 555)", 2.0),
    ("PMID: 12345, 67890 and PMID: 99999", 0.0), ("PMID: 12345 and 67890 AND 99999.", 0.0),
    ("According to PMIDs 12345 and 99999 the drug works", -1.0),
    ("PMIDs: 12345, 99999 reported benefit", -1.0),
    # not ids:
    ("PMID: 12345, 30 patients", 1.0), ("PMID: 12345, 2020 study", 1.0),
    ("(PMID: 12345, 2019)", 1.0),
    # too short
    ("PMID: 12345, 2.5 mg", 1.0), ("PMID: 12345, 30-day mortality", 1.0),
    ("PMID: 12345 and\n2. Next", 1.0),
    # no hiding place
    ("PMID:\n99999", -2.0), ("PMID: 12345,\n99999", -1.0), ("PMID-99999", -2.0),
    ("PMID#99999", -2.0),
    ("PMID=99999", -2.0), ("PubMed ID: 99999", -2.0), ("PubMed IDs: 12345 and 99999", -1.0),
    # a list's numbering on the next line is not an id
    ("Relevant PMIDs:\n1. PMID: 12345", 1.0),
])
def test_citation_grounding_rewards_valid_and_penalises_invented_ids(completion, expected):
    assert citation_grounding(completion, SOURCES) == expected


def test_citation_grounding_options():
    text = "PMID: 12345 PMID: 12345 PMID: 99999"
    assert citation_grounding(text, SOURCES, dedupe=False) == 0.0              # 1 + 1 - 2
    assert citation_grounding(text, SOURCES, normalize=True) == -0.5           # (1 - 2) / 2
    assert citation_grounding(text, SOURCES, reward_valid=0.5, penalty_invalid=-1) == -0.5
    assert citation_grounding("nothing", SOURCES, no_citation=-0.5) == -0.5
    assert citation_grounding("pmid 99999", SOURCES, ignore_case=False) == 0.0
    assert citation_grounding("doi:10.1/abc doi:10.9/zzz", {"dois": ["10.1/abc"]},
                              pattern=r"doi:(\S+)", valid_key="dois") == -1.0
    assert citation_grounding("PMID: 1", {"valid_pmids": set()}) == -2.0
    assert invented_citation("PMID: 12345, 99999", SOURCES) == 1.0 \
        and invented_citation("PMIDs 12345; 555", SOURCES) == 0.0


def test_citation_grounding_is_none_without_a_valid_set_and_raises_on_a_string_set():
    assert citation_grounding("PMID: 12345", {}) is None
    assert citation_grounding("PMID: 12345", {"valid_pmids": None}) is None
    with pytest.raises(TypeError, match="list"):
        citation_grounding("PMID: 12345", {"valid_pmids": "12345"})


# ---------------------------------------------------------------- length_penalty, short_answer

@pytest.mark.parametrize("tokens, expected", [
    (0, 0.0), (100, 0.0), (384, 0.0), (385, -1 / 128), (416, -0.25), (448, -0.5), (512, -1.0),
    (513, -1.0), (10**6, -1.0),
])
def test_length_penalty_follows_the_dapo_formula(tokens, expected):
    assert length_penalty("ignored", {}, tokens) == pytest.approx(expected)


def test_length_penalty_with_no_cache_is_a_hard_cut_and_rejects_bad_settings():
    assert length_penalty("", {}, 512, cache_tokens=0) == 0.0
    assert length_penalty("", {}, 513, cache_tokens=0) == -1.0
    assert length_penalty("", {}, 150, max_tokens=200, cache_tokens=100) == -0.5
    with pytest.raises(ValueError):
        length_penalty("", {}, 10, max_tokens=100, cache_tokens=200)


@pytest.mark.parametrize("completion, expected", [
    ("72", 1.0), ("one two three four five six seven eight", 1.0), (" ".join(["w"] * 9), 23 / 24),
    (" ".join(["w"] * 20), 0.5), (" ".join(["w"] * 31), 1 / 24), (" ".join(["w"] * 32), 0.0),
    ("w " * 1000, 0.0),
    ("", 0.0), ("   \n ", 0.0),                                 # saying nothing is not brevity
    ("<think>" + "long reasoning " * 50 + "</think> 72", 1.0),  # reasoning is not the answer
    ("<think>" + "long reasoning " * 50, 0.0),                  # unclosed: no answer
])
def test_short_answer_decays_linearly_from_max_words_to_four_times_it(completion, expected):
    assert short_answer(completion, {}) == pytest.approx(expected)


def test_short_answer_options():
    assert short_answer("a b c", {}, max_words=2) == pytest.approx(5 / 6)
    assert short_answer("<think>x y z</think>a", {}, max_words=1) == 1.0
    # 3 words
    assert short_answer("<think>x y z</think>a", {}, max_words=1, strip_think=False) == \
        pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        short_answer("a", {}, max_words=0)


def test_every_builtin_is_registered_unbatched_and_documented_with_examples():
    assert BUILTINS <= set(rewards.names())
    for name in BUILTINS:
        fn, batched = rewards.lookup(name)
        assert fn.__name__ == name and batched is False
        assert ">>> " in fn.__doc__, f"{name} has no doctest example"


# ---------------------------------------------------------------- registry and resolve

def test_register_refuses_a_second_function_under_a_taken_name(monkeypatch):
    monkeypatch.setitem(REGISTRY, "taken", (json_valid, False))
    with pytest.raises(ValueError, match="already registered"):
        register("taken")(lambda completion, sample: 1.0)
    assert REGISTRY["taken"] == (json_valid, False)


def test_resolve_names_close_matches_for_an_unknown_reward():
    with pytest.raises(ValueError, match="json_valid") as err:
        resolve(RewardSpec("json_vaild"))
    assert "unknown reward 'json_vaild'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="answer_match"):
        resolve(RewardSpec("answer_mach"))


def test_resolve_loads_a_function_from_an_importable_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod_7f3.py").write_text(
        "def polite(completion, sample, word='please'):\n    return float(word in completion)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn, batched = resolve(RewardSpec("my_rewards_mod_7f3:polite"))
    assert (fn("say please", {}), fn("no", {}), batched) == (1.0, 0.0, False)
    with pytest.raises(ValueError, match="has no function 'polit'.*'polite'"):
        resolve(RewardSpec("my_rewards_mod_7f3:polit"))
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_4a2'"):
        resolve(RewardSpec("no_such_module_4a2:fn"))


def test_resolve_loads_a_function_from_a_file_and_its_batched_mark(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(
        "from dataclasses import dataclass\n"
        "import rewards\n"
        # dataclasses need the module in sys.modules
        "@dataclass\nclass Counter:\n    n: int = 0\n"
        "def shouty(completion, sample):\n    return float(completion.isupper())\n"
        "@rewards.register('test_file_batched_9c1', batched=True)\n"
        "def lengths(completions, samples):\n    return [len(c) for c in completions]\n")
    fn, batched = resolve(RewardSpec(f"{path}:shouty"))
    assert (fn("HEY", {}), fn("hey", {}), batched) == (1.0, 0.0, False)
    fn2, batched2 = resolve(RewardSpec(f"{path}:lengths"))
    assert batched2 is True and fn2(["ab", "c"], [{}, {}]) == [2, 1]
    assert resolve(RewardSpec(f"{path}:shouty"))[0] is fn  # the file is loaded once
    REGISTRY.pop("test_file_batched_9c1")
    with pytest.raises(ValueError, match="not found"):
        resolve(RewardSpec(f"{tmp_path}/missing.py:shouty"))
    with pytest.raises(ValueError, match="no function 'shout'"):
        resolve(RewardSpec(f"{path}:shout"))
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(ValueError, match="could not load.*SyntaxError"):
        resolve(RewardSpec(f"{broken}:f"))


# ------------------------------------------------------------ answer_match on expressions (MATH)

@pytest.mark.parametrize("gold",
                         [r"x^2-5", r"2\sqrt{2}", r"[2,7)", r"\boxed{\frac{\pi}{3}}", "x + 1"])
def test_an_expression_gold_is_an_error_when_comparing_numbers_not_its_first_number(gold):
    with pytest.raises(ValueError, match="is an expression, not a number.*compare: expression"):
        answer_match(r"\boxed{2}", {"answer": gold})


@pytest.mark.parametrize("completion, gold, expected", [
    (r"So \boxed{x^2+1}", "x^2-5", 0.0),
    (r"\boxed{x^{2} + 1}.", r"x^2+1", 1.0),
    (r"\boxed{2}", r"2\sqrt{2}", 0.0),
    (r"\boxed{2\sqrt{2}}", r"2 \sqrt{2}", 1.0),
    (r"\boxed{\left(-\infty, 2\right]}", r"(-\infty,2]", 1.0),
    (r"\boxed{(-\infty,2]}", r"[2,7)", 0.0),
    # a solution: its boxed answer
    (r"\boxed{\dfrac{\pi}{3}}", r"The answer is $\boxed{\frac{\pi}{3}}$.", 1.0),
    # numbers still compare as numbers
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    # a list is not a number
    (r"\boxed{35}", "3, 5", 0.0), (r"\boxed{-23}", "-2, 3", 0.0), (r"\boxed{1000}", "1,000", 1.0),
    # units go
    (r"\boxed{5}", r"5\text{ cm}", 1.0), (r"\boxed{90}", r"90^\circ", 1.0),
    (r"\boxed{25}", r"25\%", 1.0), (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{\frac12}", "0.5", 1.0), ("#### 72", 72, 1.0),
    # text, not algebra
    (r"<think>\boxed{3}</think> \boxed{x+1}", "1+x", 0.0),
    ("<think>never closed", "x", 0.0),
    # a label goes
    (r"\boxed{x = 5}", "5", 1.0), (r"\boxed{5}", "x = 5", 1.0), (r"\boxed{y=2x+1}", "2x+1", 1.0),
    # unless it is the answer
    (r"\boxed{(C)}", "(B)", 0.0),
    (r"\boxed{5 \text{cm}}", "5", 1.0), (r"\boxed{5\,\text{cm}}", "5", 1.0),
    (r"\boxed{90°}", r"90^\circ", 1.0), (r"\boxed{\text{yes}}", "yes", 1.0),
    ("#### Final answer\n\\boxed{\\frac{1}{2}}", r"\frac12", 1.0),
    # a last #### line is an answer
    ("#### Yes", "Yes", 1.0), ("#### no solution", "no solution", 1.0),
    (r"\boxed{2\text{or}3}", "23", 0.0), (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{5\text{cm}^2}", "5", 1.0),
    (r"\boxed{30°C}", "30", 1.0), ("\\boxed{x\u22121}", "x-1", 1.0),
])
def test_compare_expression_matches_normalised_answers(completion, gold, expected):
    assert answer_match(completion, {"answer": gold}, compare="expression") == expected


@pytest.mark.parametrize("gold",
                         ["5 m", "0.5 L", "5 h", "5 m/s", "x = 5", "x=5", "A) 5", "(B) 5", "5 kg"])
def test_a_number_with_a_unit_or_a_label_is_still_a_number(gold):
    assert answer_match("#### 5", {"answer": gold}) == (1.0 if not gold.startswith("0.5") else 0.0)


def test_number_golds_keep_their_reading():
    assert answer_match("It is 72.", {"answer": "72 apples"}) == 1.0
    assert answer_match(r"\boxed{18.90}", {"answer": r"\$18.90"}) == 1.0
    assert answer_match("30", {"answer": r"30^\circ"}) == 1.0 \
        and answer_match("5", {"answer": "5%"}) == 1.0
    with pytest.raises(ValueError, match="compare must be"):
        answer_match("1", {"answer": 1}, compare="algebra")


def test_a_valid_file_adds_the_corpus_ids_to_every_rows_or_stands_alone(tmp_path):
    """BioReasoner's "if PMID in valid_papers" over its 15k-paper pool: ids valid for every row."""
    from scoring.checks import check_specs
    corpus = tmp_path / "pmids.txt"
    corpus.write_text("11111\n22222 33333\n")
    row = {"valid_pmids": ["44444"]}
    text = "PMID: 11111, PMID: 44444, PMID: 99999"
    assert citation_grounding(text, row) == -3.0  # the row's id alone: two invented
    assert citation_grounding(text, row, valid_file=str(corpus)) == 0.0  # 1 + 1 - 2
    # the corpus alone
    assert citation_grounding(text, {}, valid_key=None, valid_file=str(corpus)) == -3.0
    assert invented_citation("PMID: 22222", {}, valid_key=None, valid_file=str(corpus)) == 0.0
    # a row without the column: the file still counts
    assert citation_grounding(text, {}, valid_file=str(corpus)) == -3.0
    # a byte-order mark in front of the first id (Notepad, Excel, utf-8-sig)
    saved_by_excel = tmp_path / "bom.txt"
    saved_by_excel.write_bytes(b"\xef\xbb\xbf11111\n22222\n")
    assert citation_grounding("PMID: 11111", {}, valid_key=None,
                              valid_file=str(saved_by_excel)) == 1.0
    check_specs([RewardSpec("citation_grounding",
                            args={"valid_key": None, "valid_file": str(corpus)})])
    with pytest.raises(ValueError, match=r"args.valid_file=.*nope.txt: No such file"):
        check_specs([RewardSpec("citation_grounding",
                                args={"valid_file": str(tmp_path / "nope.txt")})])
    with pytest.raises(ValueError, match="valid_key is null and there is no args.valid_file"):
        check_specs([RewardSpec("invented_citation", args={"valid_key": None})])


def test_a_large_valid_file_is_looked_up_not_copied_for_every_completion(tmp_path):
    """A corpus of 500k ids (a slice of PubMed): each completion's score looks its ids up in the
    file's set; a copy of it per completion (the row's ids | the file's) took ~40 ms a call, minutes
    per eval."""
    corpus = tmp_path / "pmids.txt"
    corpus.write_text("\n".join(str(10_000_000 + i) for i in range(500_000)))
    text, row = "PMID: 10000001, PMID: 44444, PMID: 99999", {"valid_pmids": ["44444"]}
    assert citation_grounding(text, row, valid_file=str(corpus)) == 0.0  # read once: 1 + 1 - 2
    t0 = time.perf_counter()
    for _ in range(50):
        citation_grounding(text, row, valid_file=str(corpus))
        invented_citation(text, row, valid_file=str(corpus))
    assert time.perf_counter() - t0 < 0.5


def test_a_valid_file_that_is_not_text_is_one_line_naming_the_key(tmp_path):
    from scoring.checks import check_specs
    gz = tmp_path / "pmids.txt.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00 compressed")
    with pytest.raises(ValueError, match=r"args.valid_file=.*pmids.txt.gz: not UTF-8 text"):
        check_specs([RewardSpec("citation_grounding", args={"valid_file": str(gz)})])


def test_rubric_format_scores_the_rubric_grubrics_asks_for():
    """graders/rubrics.py: 4-8 numbered weighted criteria whose positive weights sum to 10."""
    from rewards import lookup
    fn, batched = lookup("rubric_format")
    asked = "\n".join([f"{i}. ({w} points) criterion {i}" for i, w in enumerate([4, 3, 3], 1)]
                      + ["4. (costs 5 points) unsafe advice"])
    assert not batched and fn(asked, {}) == 1.0
    assert fn(asked + "\nA closing remark.", {}) == pytest.approx(2 / 3)  # a line that is not one
    assert fn(asked.replace("(4 points)", "(5 points)"), {}) == pytest.approx(2 / 3)  # sums to 11
    assert fn("", {}) == 0.0 and fn("Be accurate and kind.", {}) == 0.0


def test_advantage_rewards_is_the_total_itself_by_default_and_gdpo_on_request():
    import math

    import torch

    import grpo
    from config import GrpoConfig
    from rewards import advantage_rewards
    specs = [RewardSpec("answer_match", weight=1.0), RewardSpec("short_answer", weight=0.5)]
    per = {"answer_match": [1.0, 0.0, 1.0, None], "short_answer": [1.0, 1.0, 0.0, None]}
    total = torch.tensor([1.5, 0.5, 1.0, math.nan])  # the last completion skipped
    assert advantage_rewards(total, per, specs, GrpoConfig(), 4) is total  # sum: untouched
    got = advantage_rewards(total, per, specs, GrpoConfig(reward_aggregation="normalize_then_sum"),
                            4)
    values = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [math.nan, math.nan]])
    expected = grpo.normalize_then_sum(values, torch.tensor([1.0, 0.5]), 4)
    assert torch.allclose(got[:3], expected[:3]) and math.isnan(got[3])
