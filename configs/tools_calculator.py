"""The multi-turn demo's own code (configs/tools_calculator.yaml): the calculator tool the model
calls, a data map that puts one worked example in front of each question, and two rewards that
give partial credit for using the tool. docs/multi-turn.md shows the run.

    python train.py --config configs/tools_calculator.yaml
"""
from __future__ import annotations

import ast
import operator

EXAMPLE = [  # one worked exchange: how a call looks, what comes back, how the answer reads
    {"role": "user", "content": "What is 123 * 45?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                     '{"expression": "123 * 45"}}</tool_call>'},
    {"role": "tool", "name": "calculator", "content": "5535"},
    {"role": "assistant", "content": "123 * 45 = 5535"},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression, e.g. "123 * 45"
    """
    def value(node):  # parsed, never evaluated as Python
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")
    result = value(ast.parse(str(expression), mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:g}"


def with_example(row: dict) -> dict:
    """data.map: the question after the worked example, as chat messages."""
    return {"prompt": [*EXAMPLE, {"role": "user", "content": row["question"]}],
            "answer": row["answer"]}


def tool_call(completion: str, sample: dict, episode) -> float:
    """1 when the episode made a calculator call that ran (well-formed JSON, a known tool)."""
    return float(any(m["role"] == "tool" and not m["content"].startswith("error")
                     for m in episode.exchanged))


def right_operands(completion: str, sample: dict, episode) -> float:
    """1 when a calculator call computed the gold product (the question's operands, multiplied)."""
    return float(any(m["role"] == "tool" and m["content"] == str(sample["answer"])
                     for m in episode.exchanged))
