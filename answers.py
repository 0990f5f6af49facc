r"""Reading an answer out of a completion, for the rule rewards in rewards.py: the text after the
think block, one JSON value, the final number (`#### n`, `\boxed{n}`, `<answer>n</answer>`, else
the last number), and math expressions compared as normalised text.

    answer_part("<think>...</think> 42")       # "42"
    final_number(r"so \boxed{\frac{3}{4}}")    # Fraction(3, 4)
    same_expression(r"x^{2} + 1", "x^2+1")     # True
"""
from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any


def find_all(pattern: str, text: str, flags: int = 0) -> list[str]:
    """Every match of pattern: its first group when it has one, else the whole match.

    >>> find_all(r"PMID: (\\d+)", "PMID: 1, PMID: 22"), find_all(r"\\d+", "a 1 b 22")
    (['1', '22'], ['1', '22'])
    """
    return [m.group(1) if m.re.groups else m.group(0) for m in re.finditer(pattern, text, flags)]


def answer_part(text: str) -> str:
    """After a leading think block (the text opens with <think>): the text after the last </think>,
    or "" when it never closes (truncated reasoning holds no answer). Without one, the whole text,
    stripped: a "</think>" that closes nothing hides nothing (free reasoning before it would
    otherwise pass as a JSON-only or a short answer). rollout.reply_prefix gives the rewards the
    <think> a chat template opens.

    >>> (answer_part("<think>2 + 2</think> 4"), answer_part("<think>2 + 2"),
    ...  answer_part("2 + 2</think>4"))
    ('4', '', '2 + 2</think>4')
    """
    if not text.lstrip().startswith("<think>"):
        return text.strip()
    _, closed, after = text.rpartition("</think>")
    return after.strip() if closed else ""


_FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```", re.S | re.I)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")  # parsers disagree on which duplicate wins: ambiguous
    return dict(pairs)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json accepts NaN and Infinity; JSON does not


def parse_json(completion: str, allow_fence: bool, strip_think: bool) -> tuple[bool, Any]:
    """(True, value) when the whole answer is one JSON value, else (False, None)."""
    text = answer_part(completion) if strip_think else completion.strip()
    if allow_fence and (fenced := _FENCE.fullmatch(text)):
        text = fenced.group(1)
    try:
        return True, json.loads(text, object_pairs_hook=_no_duplicate_keys,
                                parse_constant=_no_constants)
    except (ValueError, RecursionError):  # ValueError also covers ints longer than 4300 digits
        return False, None


# a sign only where it cannot be a minus ("3-5" is 3 and 5); 1,000 only in groups of three; .5 too
NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))(?:\.\d+)?(?:/\d+)?")


def boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, open_at = 0, start + len("\\boxed")
    for i in range(open_at, len(text)):  # match braces: \boxed{\text{\$}1{,}000} nests
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    return None


def latex_numbers(text: str) -> str:
    r"""\frac{3}{4} as 3/4, LaTeX's thousands separators (1{,}000, 1\,000) dropped, a Unicode minus
    as -, and -$5 as -5."""
    text = re.sub(r"\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*([\d.,]+)\s*\}", r"\1/\2", text)
    # a Unicode minus; -$5 is -5 ($10 - $15 is not)
    text = re.sub(r"-\\?\$(?=\d)", "-", text.replace("\u2212", "-"))
    return text.replace("{,}", ",").replace("\\,", "").replace("\\!", "")


_HASHES = re.compile(r"(?<!#)####(?!#)([^\n]*)")
# "#### Step 2: add", "#### Final Answer" with text below: Markdown, not a marker
_HEADING = re.compile(r"\s*[A-Za-z]{2,}")
# "#### Answer: 72" is one, text below or not
_ANSWER_LINE = re.compile(r"\s*(?:final\s+)?answer\b\W*\S", re.I)


def marked(text: str) -> str | None:
    """What the answer marker holds, the first kind present deciding: the last `#### x` line
    (GSM8K; not a Markdown heading: a line led by a word, with text after it), the last \\boxed{x},
    the last <answer>x</answer>; None without a marker.

    >>> (marked("#### 72"), marked("#### Step 1: add\\n48 + 24 = 72\\n\\\\boxed{72}"),
    ...  marked("#### Final answer\\n72"))
    (' 72', '72', None)
    >>> (marked("so\\n#### Yes"), marked("#### no solution\\n"),
    ...  marked("#### Answer: 72\\nsince 8 * 9 = 72"))
    (' Yes', ' no solution', ' Answer: 72')
    """
    hashes = [m.group(1) for m in _HASHES.finditer(text)
              if not (_HEADING.match(m.group(1)) and not _ANSWER_LINE.match(m.group(1))
                      and text[m.end():].strip())]
    close = text.rfind("</answer>")  # rfind, not a lazy regex, quadratic on repeated <answer>
    open_at = text.rfind("<answer>", 0, max(close, 0))
    tag = text[open_at + len("<answer>"):close] if close >= 0 and open_at >= 0 else None
    return next((s for s in (hashes[-1] if hashes else None, boxed(text), tag) if s is not None),
                None)


def final_number(text: str, mode: str = "last") -> Fraction | None:
    """The answer number of a text, exact, or None: inside the answer marker (marked) the first
    number counts (a marker without a number is no answer); without one, the first or last number
    of the text (mode)."""
    if mode not in ("first", "last"):
        raise ValueError(f"mode must be 'first' or 'last', not {mode!r}")
    text = latex_numbers(text)
    segment = marked(text)
    found = NUMBER.findall(text) if segment is None else NUMBER.findall(segment)[:1]
    if not found:
        return None
    numerator, _, denominator = found[-1 if mode == "last" else 0].replace(",", "").partition("/")
    try:
        return Fraction(numerator) / Fraction(denominator or 1)
    except (ValueError, ZeroDivisionError):  # x/0, or more digits than int() accepts
        return None


# $, %, degrees (30°C), units (\text{ cm}; 5\,\text{cm}^2 ending the answer): not the answer's maths
_UNITS = re.compile(r"\\?\$|\\?%|°(?:\s*[CF](?![A-Za-z]))?|\\text\{ [^{}]*\}"
                    r"|(?<=\d)(?:\s|\\[,;:! ])*\\text\{\s*[A-Za-z][^{}]*\}"
                    r"(?:\^\{?\d\}?)?(?=\s*\.?\s*$)|\^\{?\\circ\}?")
_LABEL = re.compile(r"^(?:[A-Za-z]\s*=|\(?[A-Ea-e]\))\s*")  # "x = 5", "(B) 5": the answer follows
_LATEX = re.compile(r"[\\^_{}]|[\[(][^\])]*,[^\[(]*[\])]")  # LaTeX, or an interval/tuple: (-1, 2]
_VARIABLE = re.compile(r"(?<![A-Za-z])[A-Za-z](?![A-Za-z])")  # a lone letter: x + 1


def expression_gold(gold: str) -> str | None:
    r"""The gold's answer when it is an expression, not a number (MATH's x^2+1, 2\sqrt{2},
    (-\infty,2]), else None: the marker's content, or a marker-less gold that is not prose.

    >>> expression_gold(r"\boxed{2\sqrt{2}}"), expression_gold("x + 1"), expression_gold(r"\$18.90")
    ('2\\sqrt{2}', 'x + 1', None)
    >>> (expression_gold(r"\frac{1}{2}"), expression_gold("72 apples"),
    ...  expression_gold("#### 1,000"), expression_gold("2 m/s"))
    (None, None, None, None)
    >>> (expression_gold("x = 5"), expression_gold("(B) 5"), expression_gold(r"90^\circ"),
    ...  expression_gold("(1, 2)"))
    (None, None, None, '(1, 2)')

    A gold that starts with a number and holds no LaTeX ("5 m", "0.5 L", "1e5") is a number, read
    as before; so is one after a label ("x = 5"). A number with a lone letter ("2x") is not caught.
    """
    text = latex_numbers(gold)
    segment = marked(text)
    if segment is None and any(w.isalpha() and len(w) >= 3 for w in text.split()):
        return None  # prose (a solution, "72 apples"): its number counts
    segment = text if segment is None else segment
    s = _LABEL.sub("", _UNITS.sub("", segment).strip())
    if _LATEX.search(s) or (not NUMBER.match(s) and _VARIABLE.search(s)):
        return segment.strip()
    return None


def normalised(expr: str) -> str:
    r"""An answer written the way MATH's graders compare them: no spaces, $, %, degrees, units
    (\text{ cm}: a \text{} starting with a space or after a number), \left / \right, spacing
    commands, \text{} wrappers or final period; \dfrac and \tfrac as \frac; \frac12 and \sqrt2
    braced; x^{2} as x^2.

    >>> (normalised(r"\left( -\infty, 2 \right]"), normalised(r"\dfrac{x^{2}}{2}."),
    ...  normalised(r"\text{(B)}"))
    ('(-\\infty,2]', '\\frac{x^2}{2}', '(B)')
    >>> (normalised(r"5\text{ cm}"), normalised(r"90^\circ"), normalised(r"25\%"),
    ...  normalised(r"\frac12 + \sqrt2"))
    ('5', '90', '25', '\\frac{1}{2}+\\sqrt{2}')
    >>> normalised(r"5\,\text{cm}"), normalised("90°"), normalised(r"\text{yes}")
    ('5', '90', 'yes')
    """
    s = _UNITS.sub("", expr.replace("\u2212", "-"))  # and a Unicode minus as -
    s = re.sub(r"\\([dt]?frac)(\d)(\d)", r"\\\1{\2}{\3}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|displaystyle|[!,;: ])", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    return re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)


def expression_key(expr: str) -> str:
    r"""normalised, and without a leading label ("x = 5" is 5, "(B) 5" is 5): what same_expression
    compares.

    >>> expression_key(r"x = \frac{1}{2}"), expression_key("(C)"), expression_key("y=2x+1")
    ('\\frac{1}{2}', '(C)', '2x+1')
    """
    s = normalised(expr)
    return _LABEL.sub("", s) or s


def same_expression(pred: str, gold: str) -> bool:
    """Equal as normalised text (expression_key), or as numbers when both are one ("0.5" and
    "\\frac{1}{2}")."""
    a, b = expression_key(pred), expression_key(gold)
    if a == b:
        return True
    x, y = (NUMBER.fullmatch(latex_numbers(v)) for v in (a, b))  # "3,5" is a list, "3,500" a number
    return bool(x and y) and final_number(x.group(0)) == final_number(y.group(0))
