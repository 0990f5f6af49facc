"""Rule rewards on a rubric the policy wrote (GRubrics), beside rubric_alignment's Spearman: the
original project weighted several terms by REWARD_LAMBDA_* variables; here each is a reward entry
whose weight can read one (`weight: ${REWARD_LAMBDA_FORMAT:-0.2}`, settings/typed_config.py).

    rewards:
      - {name: rubric_alignment, weight: "${REWARD_LAMBDA_ALIGN:-1.0}", ...}
      - {name: rubric_format, weight: "${REWARD_LAMBDA_FORMAT:-0.2}"}
      - {name: length_penalty, weight: "${REWARD_LAMBDA_LENGTH:-0.2}", args: {max_tokens: 512}}

The format checked is grubrics.yaml's system prompt's (and sources.maps.healthbench_sft's): numbered
criteria "N. (W points) text", min_criteria to max_criteria of them, whose positive weights sum to
`total`; lines "N. (costs W points) text" say what loses points.
"""
from __future__ import annotations

import re

from rewards import register

CRITERION = re.compile(r"^\s*\d+[.)]\s*\((costs\s+)?(\d+(?:\.\d+)?)\s+points?\)\s*\S", re.I)


@register("rubric_format")
def rubric_format(completion: str, sample: dict, min_criteria: int = 4, max_criteria: int = 8,
                  total: float = 10.0) -> float:
    """The share of three checks a rubric passes: (1) it holds min_criteria to max_criteria
    criteria lines (costs lines included), (2) every non-blank line is one, (3) the weights of the
    positive criteria sum to `total`. 1.0 is a rubric a grader can apply as asked.

    >>> good = "1. (6 points) Names stage 2\\n2. (4 points) Advises salt\\n3. (costs 2 points) Harm"
    >>> rubric_format(good, {}, min_criteria=3), rubric_format(good, {})
    (1.0, 0.6666666666666666)
    >>> rubric_format("A good answer is accurate.", {})
    0.0
    """
    lines = [ln for ln in completion.splitlines() if ln.strip()]
    matches = [CRITERION.match(ln) for ln in lines]
    criteria = [m for m in matches if m]
    positive = sum(float(m.group(2)) for m in criteria if not m.group(1))
    checks = [min_criteria <= len(criteria) <= max_criteria,
              bool(lines) and len(criteria) == len(lines),
              bool(criteria) and abs(positive - total) < 1e-6]
    return sum(checks) / len(checks)
