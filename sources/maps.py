"""Built-in row maps (dataset adapters): rewrite a dataset's rows into the columns a recipe reads.

    data: {name: openlifescienceai/medmcqa, map: medmcqa_json, ...}     # train.py, eval.py
    python -m tools.precompute ... --precompute.map=healthbench         # GRubrics' answer files

A map is a plain function row -> row (or None to leave the row out); data.map names one of MAPS
or "file.py:function" for your own (data.resolve_map). data.py applies it after the split.
"""
from __future__ import annotations

import json
from typing import Callable


def as_text(value) -> str:
    """A row's value as a judge or a rater reads it: chat messages as "role: content" blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in value)  # chat prompt
    return json.dumps(value, ensure_ascii=False)


def medmcqa_json(row: dict) -> dict:
    """MedMCQA (openlifescienceai/medmcqa) for the JSON classifier: adds `answer_letter` ("A"-"D"
    from the 0-based `cop`) and `target_json`, the reply SFT learns, as in the MedMCQA workflow:
    {"predicted_category": letter, "confidence": 0.95, "reason": exp cut to 250 characters}
    (a row without an explanation gets "The answer is <letter>) <option>." as its reason).

    >>> r = medmcqa_json({"question": "q", "opa": "x", "opb": "Meat", "opc": "y", "opd": "z",
    ...                   "cop": 1, "exp": None})
    >>> r["answer_letter"], json.loads(r["target_json"])["reason"]
    ('B', 'The answer is B) Meat.')
    """
    letter = _cop_letter(row)
    reason = " ".join(str(row.get("exp") or "").split())[:250].strip()
    reason = reason or f"The answer is {letter}) {row['op' + letter.lower()]}."
    target = {"predicted_category": letter, "confidence": 0.95, "reason": reason}
    return {**row, "answer_letter": letter, "target_json": json.dumps(target, ensure_ascii=False)}


def _cop_letter(row: dict) -> str:
    """MedMCQA's 0-based `cop` as the gold letter; ValueError for the test split's -1."""
    cop = row.get("cop")
    if cop == -1:  # the hub copy's test split: no answers published
        raise ValueError("MedMCQA's test split has no answers (cop = -1); hold out rows of train "
                         "(eval.select), or use split validation (4,183 answered rows)")
    if isinstance(cop, bool) or not isinstance(cop, int) or not 0 <= cop <= 3:
        raise ValueError(f"cop must be an option index 0-3, got {cop!r}")
    return "ABCD"[cop]


def medmcqa(row: dict) -> dict:
    """MedMCQA for GRubrics' verifiable questions, as `medqa` writes MedQA: `question` with its
    options A-D appended, `answer` the gold letter, `answer_text` that option's text.

    >>> r = medmcqa({"question": "q?", "opa": "x", "opb": "Meat", "opc": "y", "opd": "z", "cop": 1})
    >>> r["question"].splitlines()[1:3], r["answer"], r["answer_text"]
    (['A) x', 'B) Meat'], 'B', 'Meat')
    """
    letter = _cop_letter(row)
    options = "\n".join(f"{k}) {row['op' + k.lower()]}" for k in "ABCD")
    return {**row, "question": f"{str(row['question']).strip()}\n{options}", "answer": letter,
            "answer_text": row["op" + letter.lower()]}


def healthbench(row: dict) -> dict:
    """HealthBench (openai/simple-evals' JSONL: `prompt` a conversation, `rubrics` the physicians'
    criteria with points) for GRubrics: adds `question` (a lone user turn as its text, a longer
    conversation as "role: content" blocks), `rubric` (one criterion a line, points first) and `id`.

    >>> r = healthbench({"prompt": [{"role": "user", "content": "Is 145/92 high?"}], "rubrics": [
    ...     {"criterion": "Says it is stage 2 hypertension", "points": 5}], "prompt_id": "p1"})
    >>> r["question"], r["rubric"], r["id"]
    ('Is 145/92 high?', '[+5] Says it is stage 2 hypertension', 'p1')
    """
    conv, rubrics = row["prompt"], row["rubrics"]
    if not (isinstance(conv, list) and conv and isinstance(rubrics, list) and rubrics):
        raise ValueError("a HealthBench row needs a conversation under 'prompt' and criteria under "
                         "'rubrics'")
    question = conv[0]["content"] if len(conv) == 1 else as_text(conv)
    rubric = "\n".join(f"[{float(c['points']):+g}] {c['criterion']}" for c in rubrics)
    return {**row, "question": question, "rubric": rubric,
            "id": row.get("prompt_id", row.get("id"))}


def _weights(points: list[float], total: int = 10) -> list[int]:
    """Positive points as whole weights >= 1 summing to `total`, in proportion (largest remainders).

    >>> _weights([5, 5, 4]), _weights([7, 1, 1, 1, 1, 1, 1, 1])
    ([4, 3, 3], [3, 1, 1, 1, 1, 1, 1, 1])
    """
    raw = [total * p / sum(points) for p in points]
    w = [max(1, int(r)) for r in raw]
    while sum(w) != total:
        if sum(w) < total:
            i = max(range(len(w)), key=lambda j: (raw[j] - w[j], -j))
            w[i] += 1
        else:
            i = min((j for j in range(len(w)) if w[j] > 1), key=lambda j: (raw[j] - w[j], j))
            w[i] -= 1
    return w


def healthbench_sft(row: dict, max_criteria: int = 8) -> dict | None:
    """HealthBench for GRubrics' SFT warm-up: `healthbench`'s columns, and `rubric_target`, the
    physicians' rubric written as grubrics.yaml's system prompt asks the policy to write one:
    numbered criteria whose weights sum to 10 (the positive points, rescaled), then what costs
    points (the negative ones, on the same scale). The 8 criteria of most points either way are
    kept; a row with fewer than 4, or none positive, is left out.

    >>> r = healthbench_sft({"prompt": [{"role": "user", "content": "Is 145/92 high?"}],
    ...     "rubrics": [{"criterion": "Says stage 2", "points": 5},
    ...                 {"criterion": "Advises less salt", "points": 5},
    ...                 {"criterion": "Suggests home monitoring", "points": 4},
    ...                 {"criterion": "Says ignore it", "points": -6}]})
    >>> print(r["rubric_target"])
    1. (4 points) Says stage 2
    2. (3 points) Advises less salt
    3. (3 points) Suggests home monitoring
    4. (costs 4 points) Says ignore it
    >>> many = [{"criterion": f"c{i}", "points": 10 - i} for i in range(10)]
    >>> many += [{"criterion": "harm", "points": -99}]
    >>> r = healthbench_sft({"prompt": [{"role": "user", "content": "q"}], "rubrics": many})
    >>> r["rubric_target"].splitlines()[-1]
    '8. (costs 10 points) harm'
    >>> healthbench_sft({"prompt": [{"role": "user", "content": "q"}], "rubrics": [
    ...     {"criterion": f"bad{i}", "points": -1} for i in range(4)]}) is None  # none worth points
    True
    """
    row = healthbench(row)
    # stable: ties in file order
    crit = sorted(row["rubrics"], key=lambda c: -abs(float(c["points"])))[:max_criteria]
    good = sorted((c for c in crit if float(c["points"]) > 0), key=lambda c: -float(c["points"]))
    bad = sorted((c for c in crit if float(c["points"]) < 0), key=lambda c: float(c["points"]))
    if len(good) + len(bad) < 4 or not good:
        return None
    top = sum(float(c["points"]) for c in good)
    lines = [f"({w} points) {c['criterion']}"
             for c, w in zip(good, _weights([float(c["points"]) for c in good]))]
    lines += [f"(costs {min(10, max(1, round(10 * -float(c['points']) / top)))} points) "
              f"{c['criterion']}" for c in bad]
    return {**row, "rubric_target": "\n".join(f"{i}. {line}" for i, line in enumerate(lines, 1))}


def medqa(row: dict) -> dict:
    r"""MedQA (GBaker/MedQA-USMLE-4-options: `options` {"A": text, ...}, or a [{key, value}] list as
    other copies hold it, and `answer_idx`) for GRubrics' verifiable questions: `question` with its
    lettered options appended, `answer` the gold letter (the answer's text kept as `answer_text`).

    >>> r = medqa({"question": "Most likely cause?", "options": {"A": "Iron", "B": "B12"},
    ...            "answer_idx": "A", "answer": "Iron"})
    >>> r["question"], r["answer"], r["answer_text"]
    ('Most likely cause?\nA) Iron\nB) B12', 'A', 'Iron')
    """
    opts = row["options"]
    items = (sorted(opts.items()) if isinstance(opts, dict)
             else [(o["key"], o["value"]) for o in opts])
    question = str(row["question"]).strip() + "\n" + "\n".join(f"{k}) {v}" for k, v in items)
    return {**row, "question": question, "answer": row["answer_idx"],
            "answer_text": row.get("answer")}


def split_messages(row: dict) -> dict:
    """A chat SFT row (TRL's `messages`, ending with the assistant's reply) as TRL's
    prompt-completion form: `prompt` the messages before the reply, `completion` the reply's text,
    for a reward's gold (args.gold_key: completion). For a mixture source with `prompt: prompt`
    (data.target would split every source); a row whose messages end elsewhere is left out.

    >>> r = split_messages({"messages": [{"role": "user", "content": "2+2?"},
    ...                                  {"role": "assistant", "content": "4"}]})
    >>> r["prompt"], r["completion"]
    ([{'role': 'user', 'content': '2+2?'}], '4')
    >>> split_messages({"messages": [{"role": "user", "content": "2+2?"}]}) is None  # no reply
    True
    >>> split_messages({"text": "x"})
    Traceback (most recent call last):
    ValueError: split_messages needs a column 'messages' holding a list of {role, content} messages
    """
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise ValueError("split_messages needs a column 'messages' holding a list of "
                         "{role, content} messages")
    if (len(msgs) < 2 or msgs[-1].get("role") != "assistant"
            or not isinstance(msgs[-1].get("content"), str)):
        return None
    return {**row, "prompt": msgs[:-1], "completion": msgs[-1]["content"]}


MAPS: dict[str, Callable[[dict], dict]] = {"medmcqa_json": medmcqa_json, "medmcqa": medmcqa,
                                           "healthbench": healthbench,
                                           "medqa": medqa, "healthbench_sft": healthbench_sft,
                                           "split_messages": split_messages}
