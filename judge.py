"""LLM judges as GRPO rewards: templates, reply parsing, the judge rewards, several judges in a run.

    from judge import group_judge, judge_reward, rubric_alignment, open_judges
    judges = open_judges(cfg.judge, cfg.judges)  # by name: {"judge": ..., "second": ...}
    rewards = judge_reward(completions, samples, judge=judges["judge"])  # list[float]; NaN: failed
    rewards = group_judge(completions, samples, judge=judges["judge"])  # one request a group

A judge is a client.Judge (cache, retries, rate limit, cost). A reply is parsed for a score in
[score_min, score_max] (JSON, the last "Score: 7", "7/10", "7 out of 10", a lone number; a reasoning
model's thinking, up to its last </think>, is ignored); one without a usable score is a failure,
which the reward's fallback covers. Configuration errors (unknown template, missing sample field)
raise, and are checked before a run (check_args, row_fields: checks.check_specs and check_rows).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from functools import partial

from scipy.stats import spearmanr

from api.client import Judge, JudgeConfig, mask_urls
from rewards import register
from sources.maps import as_text


@dataclass
class JudgeScore:
    score: float  # the composite: the "score" key, or the mean of the criteria
    criteria: dict[str, float]  # per-criterion scores ({} when the reply gave only a score)


# --- parsing --------------------------------------------------------------------------------------
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S)  # thinking: numbers in it are not the verdict
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S | re.I)
# "Score: 7", "**Score**: 7.5", "Score (0-10): 7"; not the range in "a score of 1-10".
# The last labelled one ("Score: 7", "final score = 7") counts, else the first ("a score of 7"):
# "... a score of 9 would need ..." is not it
_SCORE_TEXT = re.compile(r"score(?:\s*\([^)]*\))?\W{0,5}?(?:(?:is|of)\s*)?(-?\d+(?:\.\d+)?)"
                         r"(?!\d|\.\d|[ \t]*(?:[-–]|to)[ \t]*\d)", re.I)
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*\d+")  # "7/10" (the numerator as is)
_OUT_OF = re.compile(r"(-?\d+(?:\.\d+)?)\s*out of\s*\d+")  # "7 out of 10", only without a "7/10"
#   ("3 out of 5 claims ... 8/10")
_LONE_NUMBER = re.compile(r"[\s*]*(-?\d+(?:\.\d+)?)[\s*]*\.?\s*")  # "8", "**8**"
_NUMBER_TEXT = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


def _number(v) -> float | None:
    """A JSON value as a score: a number, or one in a string ({"score": "8"}); never a boolean."""
    if isinstance(v, str) and _NUMBER_TEXT.fullmatch(v):
        v = float(v)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)  # JSON true would be 1 otherwise
    return float(v) if ok and math.isfinite(v) else None  # json.loads accepts NaN and Infinity


def _first_json_object(text: str) -> dict | None:
    decoder = json.JSONDecoder()
    for candidate in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        i = candidate.find("{")
        while i != -1:
            try:
                obj, _ = decoder.raw_decode(candidate, i)
                if isinstance(obj, dict):
                    return obj
            except ValueError:
                pass
            i = candidate.find("{", i + 1)
    return None


def _verdict_text(text: str) -> str:
    """A judge reply minus its thinking (up to the last </think>, or an unclosed <think> block)."""
    return _THINK.sub("", text.rsplit("</think>", 1)[-1]).strip()


def _verdict_json(text: str) -> tuple[str, dict | None]:
    """A judge reply's verdict text and the first JSON object in it (None: none)."""
    text = _verdict_text(text)
    return text, _first_json_object(text)


def parse_score(text: str, score_min: float = 0.0, score_max: float = 10.0,
                criteria: list[str] | None = None) -> JudgeScore | None:
    """A JudgeScore from a judge reply, or None if there is no valid in-range score.

    A reasoning model's thinking is dropped first: all up to its last </think> (templates that
    open <think> themselves send only the close), or an unclosed <think> block to the end.
    JSON next (a ```json block, the whole reply, or its first {...}): the "score" key, else the
    criteria (all named ones must be numbers; without names, every numeric value of a reply that
    starts or ends with the object, or fences it, not one quoted mid-prose), score = their mean.
    Without a JSON verdict: the last labelled "Score: 7" (else the first "score of 7"), else "7/10",
    else "7 out of 10", else a lone number.
    Every value must be in [score_min, score_max]; booleans, NaN and words are not numbers ("8" is).

    >>> parse_score('{"relevance": 6, "clarity": 8}')
    JudgeScore(score=7.0, criteria={'relevance': 6.0, 'clarity': 8.0})
    >>> parse_score('Good answer. Score: 7/10').score
    7.0
    >>> parse_score('{"score": true}') is None, parse_score('{"score": 11}') is None
    (True, True)
    """
    if not isinstance(text, str):
        return None
    text, obj = _verdict_json(text)
    alone = text.startswith("{") or text.endswith("}") or _FENCE.search(text) is not None
    if (obj is not None and not criteria and "score" not in {str(k).lower() for k in obj}
            and not alone):
        obj = None  # {"a": 1, "b": 3} quoted in the judge's prose
    if obj is not None:  # a JSON verdict is final: never fall back to grabbing a number out of it
        verdict = _json_score(obj, criteria)
        if verdict is None:
            return None
        score, per = verdict
    elif criteria:
        return None  # named criteria can only come from JSON
    else:
        score, per = _text_score(text), {}
    if score is None or not all(score_min <= v <= score_max for v in [score, *per.values()]):
        return None
    return JudgeScore(score, per)


def _json_score(obj: dict, criteria: list[str] | None) -> tuple[float | None, dict] | None:
    """(score, criteria) from a JSON verdict: its "score", else the mean of the criteria (the named
    ones, all numbers; or every numeric value); None when they are missing or not numbers.

    >>> _json_score({"Clarity": 6, "depth": 8}, ["clarity", "depth"])
    (7.0, {'clarity': 6.0, 'depth': 8.0})
    """
    fields = {str(k).lower(): v for k, v in obj.items()}
    if criteria:
        per = {c: _number(fields.get(c.lower())) for c in criteria}
    elif "score" in fields:
        per = {}
    else:
        per = {k: _number(v) for k, v in fields.items() if _number(v) is not None}
    if (not per and "score" not in fields) or any(v is None for v in per.values()):
        return None
    score = _number(fields["score"]) if "score" in fields else sum(per.values()) / len(per)
    return score, per


def _text_score(text: str) -> float | None:
    """The score in a reply without a JSON verdict: the last labelled "Score: 7" (else the first
    "score of 7"), else "7/10", else "7 out of 10", else a lone number.

    >>> _text_score("A score of 6. Final Score: 8"), _text_score("I give it 3 out of 5")
    (8.0, 3.0)
    """
    ms = [*_SCORE_TEXT.finditer(text)]
    labelled = [x for x in ms if re.search(r"[:=]", x.group(0))]
    m = ((labelled or ms[:1] or [None])[-1] or _FRACTION.search(text) or _OUT_OF.search(text)
         or _LONE_NUMBER.fullmatch(text))
    return float(m.group(1)) if m else None


# --- templates ------------------------------------------------------------------------------------
# {name} comes from the sample, plus {completion}, {score_min}, {score_max} (and {rubric}, {answer},
# {question} in rubric_alignment). Any other brace, e.g. the JSON shapes below, is left alone.
POINTWISE_CRITERIA = """You are an expert technical interviewer judging a screening question written for the role below.

Role and context:
{prompt}

Question to judge:
{completion}

Score the question from {score_min} to {score_max} on each criterion:
- relevance: does it test skills the role actually needs?
- clarity: is it unambiguous and well-formed?
- discriminative_power: would it separate strong candidates from weak ones?

Reply with only a JSON object: {"relevance": <number>, "clarity": <number>, "discriminative_power": <number>}"""  # noqa: E501

RUBRIC_SCORING = """You are grading an answer strictly by the rubric below.

Question:
{question}

Rubric:
{rubric}

Answer to grade:
{answer}

Apply only the rubric, nothing else. Score the answer from {score_min} to {score_max}.
Reply with only a JSON object: {"score": <number>}"""

LOGIC_NOVELTY = """You are a senior scientist reviewing a piece of biomedical reasoning.

Question:
{prompt}

Reasoning to review:
{completion}

Score from {score_min} to {score_max}:
- logic: is each step sound and supported, with no leaps or contradictions?
- novelty: does it go beyond textbook or generic hypotheses?

Reply with only a JSON object: {"logic": <number>, "novelty": <number>}"""

CRITERION_MET = """You are checking one criterion of a grading rubric against an answer.

Question:
{question}

Answer:
{answer}

Criterion ({points} points):
{criterion}

Does the answer meet the criterion? A criterion with negative points names something an answer should
not do: it is met when the answer does it.
Reply with only a JSON object: {"met": <number>}, the number 1 if the criterion is met, 0 if not."""  # noqa: E501

GROUP_SCORING = """You are comparing several answers to the same request.

Request:
{prompt}

The answers, labelled [Answer 1] to [Answer {n}]:

{completions}

Score each answer from {score_min} to {score_max}, comparing them with each other: a better answer gets a higher score, equally good answers get the same score.
Reply with only a JSON object holding the {n} scores in the answers' order: {"scores": [<number>, ...]}"""  # noqa: E501

TEMPLATES = {"pointwise_criteria": POINTWISE_CRITERIA, "rubric_scoring": RUBRIC_SCORING,
             "logic_novelty": LOGIC_NOVELTY, "criterion_met": CRITERION_MET,
             "group_scoring": GROUP_SCORING}
TEMPLATE_CRITERIA = {"pointwise_criteria": ["relevance", "clarity", "discriminative_power"],
                     "logic_novelty": ["logic", "novelty"]}  # the JSON keys each template requires
_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")


def load_template(spec: str) -> str:
    """A built-in template name, a path to a text file, or the template text itself."""
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read()
    if _PLACEHOLDER.search(spec):
        return spec
    raise ValueError(f"template {spec!r} is not one of {sorted(TEMPLATES)}, a file, "
                     f"or text with a {{placeholder}}")


def render(template: str, fields: dict) -> str:
    """Fill {name} tokens in one pass, so braces inside the filled-in text are never touched.

    >>> render("Q: {q} A: {a}", {"q": "f({x})", "a": '{"k": 1}'})
    'Q: f({x}) A: {"k": 1}'
    """
    missing = sorted(_placeholders(template) - fields.keys())
    if missing:
        raise KeyError(f"judge template needs field(s) {missing}; the sample has {sorted(fields)}")
    return _PLACEHOLDER.sub(lambda m: as_text(fields[m.group(1)]), template)


def _chat(text: str, system: str | None = None) -> list[dict]:
    return (([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": text}])


# --- several judges in one run --------------------------------------------------------------------
DEFAULT = "judge"  # the judge: section's name among a run's judges; judges: keys name the others


def open_judges(default: JudgeConfig | None, named: dict[str, JudgeConfig]) -> dict[str, Judge]:
    """A run's judges by name: the judge: section as "judge", then the judges: section's. A judge
    reward calls "judge", or the one its args name ({judge: second}). ValueError names the judge."""
    judges: dict[str, Judge] = {}
    for name, cfg in [*([(DEFAULT, default)] if default else []), *named.items()]:
        key = "judge" if name == DEFAULT else f"judges.{name}"
        judges[name] = Judge(cfg, label=key)  # a ValueError names the section itself
        if judges[name].key_missing:
            where = mask_urls(judges[name].cfg.azure_endpoint
                              or judges[name].cfg.base_url)  # ${NAME}s filled in
            print(f"[minigrpo] warning: {key}: ${judges[name].cfg.api_key_env} is not set, and "
                  f"{where} is not on this machine: its calls will be refused "
                  "(export the key, or set api_key_env)", file=sys.stderr)
    return judges


def judges_stats(judges: dict[str, Judge]) -> dict[str, float]:
    """Every judge's counters since the last call: judge_<stat> for the judge: section (as always),
    judges/<name>/<stat> for a named one; each with its run total (<stat>_total)."""
    return {k: v for name, j in judges.items()
        for k, v in j.pop_step_stats("judge_" if name == DEFAULT else f"judges/{name}/").items()}


# --- rewards --------------------------------------------------------------------------------------
def judge_reward(completions: list[str], samples: list[dict], *, judge: Judge,
                 template: str = "pointwise_criteria", criteria: list[str] | None = None,
                 system: str | None = None, normalize: bool = True,
                 criterion: str | None = None) -> list[float]:
    """Judge score of each completion: (score - score_min) / (score_max - score_min) when normalize.

    The composite is the reply's "score", else the mean of the criteria (by default the built-in
    template's, e.g. relevance, clarity, discriminative_power). `criterion` returns that one
    criterion's score instead: list the reward once more per criterion, with weight 0 and a label,
    to log or evaluate each one; the judge's cache answers those calls, so they cost nothing.
    NaN where the judge failed: compute_rewards turns it into the reward's fallback and counts it
    in reward_errors/<name>.
    """
    criteria = _judge_criteria(template, criteria, criterion)
    text, cfg = load_template(template), judge.cfg
    scale = {"score_min": cfg.score_min, "score_max": cfg.score_max}
    chats = [_chat(render(text, {**s, **scale, "completion": c}), system)
             for c, s in zip(completions, samples, strict=True)]
    scores = judge.score_many(chats, parse=partial(parse_score, criteria=criteria))
    span = cfg.score_max - cfg.score_min
    values = [None if s is None else (s.criteria[criterion] if criterion else s.score)
              for s in scores]
    return [math.nan if v is None else ((v - cfg.score_min) / span if normalize else v)
            for v in values]


def group_judge(completions: list[str], samples: list[dict], *, judge: Judge,
                template: str = "group_scoring", system: str | None = None,
                normalize: bool = True, group_size: int | None = None) -> list[float]:
    """The judge's score of each completion, seen beside the rest of its group: one request a
    prompt shows its completions labelled [Answer 1] .. [Answer G] and asks for G scores as
    {"scores": [...]} (parse_group), (score - score_min) / (score_max - score_min) when normalize.

    A group is a run of consecutive completions of the same sample (the same row object, as the
    step and eval.py lay them out), cut into group_size (G: the trainer and eval.py pass it). A
    reply without exactly G in-range scores is a failure of the whole group (NaN each: its
    fallback; judge_unusable counts the request), never a made-up score.
    Identical completions get the mean of their scores, as a rule reward would give them one. The
    request holds the group's text, so the judge's cache answers a rerun; its counters and the
    failed-share, outage and unusable rules (scoring/outage.py) count requests, one a group.
    """
    text, cfg = load_template(template), judge.cfg
    scale = {"score_min": cfg.score_min, "score_max": cfg.score_max}
    groups = _groups(samples, group_size)
    chats = [_chat(render(text, {**samples[a], **scale, "n": b - a,
                                 "completions": _labelled(completions[a:b])}), system)
             for a, b in groups]
    replies = judge.score_many(chats, [group_parser(b - a, cfg) for a, b in groups])
    span, out = cfg.score_max - cfg.score_min, [math.nan] * len(completions)
    for (a, b), scores in zip(groups, replies):
        if scores is None:
            continue
        by_text: dict[str, list[float]] = {}
        for c, v in zip(completions[a:b], scores):
            by_text.setdefault(c, []).append(v)
        for i in range(a, b):
            v = sum(by_text[completions[i]]) / len(by_text[completions[i]])
            out[i] = (v - cfg.score_min) / span if normalize else v
    return out


def _groups(samples: list[dict], size: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of each prompt's group: runs of consecutive samples that are one object, cut
    into `size` (G) where given, as one row drawn twice in a row is two groups.

    >>> a, b = {"prompt": "x"}, {"prompt": "x"}
    >>> _groups([a, a, b, b, b]), _groups([a, a, a, a, b, b], size=2)
    ([(0, 2), (2, 5)], [(0, 2), (2, 4), (4, 6)])
    """
    starts = [i for i, s in enumerate(samples) if i == 0 or s is not samples[i - 1]
              or size and i % size == 0]
    return list(zip(starts, starts[1:] + [len(samples)]))


def _labelled(completions: list[str]) -> str:
    return "\n\n".join(f"[Answer {k}]\n{c}" for k, c in enumerate(completions, 1))


def parse_group(text: str, score_min: float = 0.0, score_max: float = 10.0, *,
                n: int) -> list[float] | None:
    """The n scores of a group judge's reply, or None: a JSON object (the whole reply after any
    thinking, or a ```json block) whose "scores" is a list of exactly n numbers in
    [score_min, score_max]. Nothing else is read: no partial list, no number out of prose.

    >>> parse_group('{"scores": [7, 3, 9]}', n=3), parse_group('{"scores": [7, 3]}', n=3)
    ([7.0, 3.0, 9.0], None)
    >>> parse_group('Scores: 7, 3, 9', n=3), parse_group('{"scores": [7, 3, 11]}', n=3)
    (None, None)
    """
    if not isinstance(text, str):
        return None
    text, obj = _verdict_json(text)
    alone = text.startswith("{") and text.endswith("}") or _FENCE.fullmatch(text) is not None
    scores = {str(k).lower(): v for k, v in obj.items()}.get("scores") if obj and alone else None
    if not isinstance(scores, list) or len(scores) != n:
        return None
    values = [_number(v) for v in scores]
    if any(v is None or not score_min <= v <= score_max for v in values):
        return None
    return values


def group_parser(n: int, cfg: JudgeConfig) -> partial:
    """parse_group for a group of n, saying what it wants (score_many's line on a bad reply)."""
    parse = partial(parse_group, n=n)
    parse.want = (f'{{"scores": [...]}} holding {n} numbers in '
                  f'[{cfg.score_min:g}, {cfg.score_max:g}], one per answer')
    return parse


def grade_answers(judge: Judge, rubrics: list, samples: list[dict], *,
                  template: str = "rubric_scoring", answers_key: str = "answers",
                  question_key: str = "question") -> list[list[float | None]]:
    """The judge's score of each of sample i's answers (samples[i][answers_key]) under rubrics[i]:
    one list per sample, None where a call failed. All calls run concurrently. Used by
    rubric_alignment (the rubric a completion) and tools/precompute.py (the rubric an expert's)."""
    text, cfg = load_template(template), judge.cfg
    scale = {"score_min": cfg.score_min, "score_max": cfg.score_max}
    chats, spans = [], []
    for rubric, s in zip(rubrics, samples, strict=True):
        start = len(chats)
        for answer in s[answers_key]:
            fields = {**s, **scale, "question": s[question_key], "rubric": rubric, "answer": answer}
            chats.append(_chat(render(text, fields)))
        spans.append((start, len(chats)))
    scores = judge.score_many(chats, parse_score)
    return [[None if g is None else g.score for g in scores[a:b]] for a, b in spans]


def parse_met(text: str, score_min: float = 0.0, score_max: float = 1.0) -> JudgeScore | None:
    """A criterion_met verdict: {"met": 1} or {"met": 0}, or true / false (whatever the judge's own
    score range); HealthBench's grader template answers {"explanation": ..., "criteria_met": true}.

    >>> (parse_met('{"met": 1}').score, parse_met('{"met": 0}').score, parse_met('{"met": 7}'),
    ...  parse_met("yes"))
    (1.0, 0.0, None, None)
    >>> (parse_met('{"met": true}').score,
    ...  parse_met('{"explanation": "It does.", "criteria_met": false}').score)
    (1.0, 0.0)
    >>> parse_met('{"criteria_met": 1}').score, parse_met('{"criteria_met": 2}')
    (1.0, None)
    """
    verdict = parse_score(text, 0.0, 1.0, criteria=["met"])
    if verdict is None and isinstance(text, str):
        obj = {str(k).lower(): v
               for k, v in (_verdict_json(text)[1] or {}).items()}
        met = obj.get("met", obj.get("criteria_met"))
        if isinstance(met, bool) or (type(met) in (int, float) and met in (0, 1)):
            return JudgeScore(float(met), {"met": float(met)})
    return verdict


# score_many's message
parse_met.want = '{"met": 1} or {"met": 0} (or true / false; HealthBench\'s "criteria_met")'


def criteria_gold(judge: Judge, criteria: list[list[dict]], samples: list[dict], *,
                  template: str = "criterion_met", answers_key: str = "answers",
                  question_key: str = "question") -> list[list[float | None]]:
    """HealthBench's score of each of sample i's answers under its physicians' criteria[i]
    ([{criterion, points}, ...]): the judge says per criterion whether the answer meets it, and

        score = clip(sum of the points of the criteria met / sum of the positive points, 0, 1)

    (a negative criterion met takes its points off). One call per answer and criterion, all at once;
    None where a call failed."""
    text, chats, spans = load_template(template), [], []
    for crit, s in zip(criteria, samples, strict=True):
        for answer in s[answers_key]:
            start = len(chats)
            for c in crit:
                fields = {**s, "question": s[question_key], "answer": answer,
                          "criterion": c["criterion"], "points": f"{float(c['points']):+g}"}
                chats.append(_chat(render(text, fields)))
            spans.append((start, len(chats), crit))
    verdicts = judge.score_many(chats, parse_met)
    gold = []
    for a, b, crit in spans:
        met = verdicts[a:b]
        top = sum(float(c["points"]) for c in crit if float(c["points"]) > 0)
        gold.append(None if any(v is None for v in met) else
                    min(1.0, max(0.0, sum(float(c["points"]) for c, v in zip(crit, met)
                                          if v.score >= 0.5) / top)))
    per = iter(gold)
    return [[next(per) for _ in s[answers_key]] for s in samples]


def rubric_alignment(completions: list[str], samples: list[dict], *, judge: Judge,
                     template: str = "rubric_scoring", answers_key: str = "answers",
                     gold_key: str = "gold_scores", question_key: str = "question") -> list[float]:
    """Spearman rho between the judge's scores of a sample's K answers under the completion
    (a rubric) and the sample's gold scores: rho = Pearson(rank(judge), rank(gold)), in [-1, 1].

    All K x N judge calls run concurrently. A constant score (or gold) vector has no ranking: 0.0,
    counted as judge_constant_scores. Any failed call -> NaN for that completion (the fallback).
    """
    for s in samples:
        answers, gold = s[answers_key], s[gold_key]
        if len(answers) != len(gold) or len(answers) < 2:
            raise ValueError(f"rubric_alignment needs >= 2 answers and as many gold scores; "
                             f"got {len(answers)} answers, {len(gold)} gold scores")
    graded = grade_answers(judge, completions, samples, template=template, answers_key=answers_key,
                           question_key=question_key)
    rewards: list[float] = []
    for x, s in zip(graded, samples):
        if any(v is None for v in x):
            rewards.append(math.nan)
            continue
        y = [float(v) for v in s[gold_key]]
        if len(set(x)) < 2 or len(set(y)) < 2:
            judge.add_stat("constant_scores")
            rewards.append(0.0)
            continue
        rho = float(spearmanr(x, y).statistic)
        rewards.append(rho if math.isfinite(rho) else 0.0)
    return rewards


# --- checks before a run (checks.check_specs / check_rows) ---------------------------------------
def _judge_criteria(template: str, criteria: list[str] | None,
                    criterion: str | None) -> list[str] | None:
    """judge_reward's criteria (the template's by default); criterion must be one of them."""
    load_template(template)
    criteria = criteria if criteria is not None else TEMPLATE_CRITERIA.get(template)
    if criterion is not None and criterion not in (criteria or []):
        raise ValueError(f"reward 'judge': criterion {criterion!r} is not one of the judge's "
                         f"criteria {criteria or []}")
    return criteria


def _check_judge_args(template: str = "pointwise_criteria", criteria: list[str] | None = None,
                      criterion: str | None = None, **_) -> None:
    """judge_reward's args, checked before any model loads: a known template, a valid criterion."""
    _judge_criteria(template, criteria, criterion)


def _placeholders(text: str) -> set[str]:
    """The {name} fields a template reads."""
    return {m.group(1) for m in _PLACEHOLDER.finditer(text)}


def _judge_row_fields(template: str = "pointwise_criteria", **_) -> set[str]:
    """The row columns judge_reward's template reads (the rest it fills itself)."""
    return _placeholders(load_template(template)) - {"completion", "score_min", "score_max"}


def _group_row_fields(template: str = "group_scoring", **_) -> set[str]:
    """The row columns group_judge's template reads (the rest it fills itself)."""
    return _placeholders(load_template(template)) - {"completions", "n", "score_min", "score_max"}


def _rubric_row_fields(template: str = "rubric_scoring", **_) -> set[str]:
    return _placeholders(load_template(template)) - {
        "question", "rubric", "answer", "score_min", "score_max"}


def criteria_row_fields(template: str = "criterion_met") -> set[str]:
    """The row columns a criteria_gold template reads beyond what it fills itself (question, answer,
    criterion, points), checked before any answer is paid for."""
    return _placeholders(load_template(template)) - {
        "question", "answers", "answer", "criterion", "points"}


def _check_rubric_args(template: str = "rubric_scoring", **_) -> None:
    load_template(template)


def _check_group_args(template: str = "group_scoring", **_) -> None:
    load_template(template)


def _check_rubric_row(row: dict, answers_key: str = "answers", gold_key: str = "gold_scores",
                      **_) -> None:
    """A row rubric_alignment can score: >= 2 answers (text) and as many finite gold scores. Checked
    when the data loads: a bad row would fail its whole batch after the judge calls were paid."""
    answers, gold = row.get(answers_key), row.get(gold_key)
    for key, value in ((answers_key, answers), (gold_key, gold)):
        if isinstance(value, str):
            raise ValueError(f"{key} is text, not a list ({value[:40]!r}): a CSV cell holds text; "
                             "write the file as .jsonl or .parquet, "
                             "or decode the column in a data.map")
    if not _is_list(answers) or len(answers) < 2 or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{answers_key} must be a list of >= 2 answers (text), "
                         f"got {str(answers)[:80]}")
    if not _is_list(gold) or len(gold) != len(answers) or not all(_finite(g) for g in gold):
        raise ValueError(f"{gold_key} must be {len(answers)} numbers, one per answer "
                         f"(no null or NaN), got {str(gold)[:80]}")


def _is_list(value) -> bool:  # a list, a tuple, a numpy array from parquet: not text, not a mapping
    return (hasattr(value, "__len__") and hasattr(value, "__iter__")
            and not isinstance(value, (str, bytes, dict)))


def _finite(value) -> bool:  # a number to rubric_alignment's float() (numpy ints, Decimal, True)
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


judge_reward.check_args, judge_reward.row_fields = _check_judge_args, _judge_row_fields
rubric_alignment.check_args, rubric_alignment.row_fields = _check_rubric_args, _rubric_row_fields
rubric_alignment.check_row = _check_rubric_row
group_judge.check_args, group_judge.row_fields = _check_group_args, _group_row_fields
register("judge", batched=True)(judge_reward)
register("group_judge", batched=True)(group_judge)
register("rubric_alignment", batched=True,
         row_keys=("answers_key", "gold_key", "question_key"))(rubric_alignment)
