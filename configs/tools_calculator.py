"""The multi-turn demo's own code (configs/tools_calculator.yaml): the calculator environment, as
a class written for TRL's GRPOTrainer(environment_factory=Calculator) that minigrpo runs unchanged
(its method `calculator` is the tool, get_reward gives partial credit for using it), and a data map
that puts one worked example in front of each question. docs/multi-turn.md shows the run.

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


class Calculator:
    """A calculator the model may call; it scores the episode's use of it: 0.25 for a call that
    ran, 0.25 more for one that computed the question's product (its gold answer)."""

    def reset(self, **row) -> None:
        self.answer, self.ran, self.right = str(row["answer"]), False, False

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

        Args:
            expression: the expression, e.g. "123 * 45"
        """
        result = evaluate(expression)
        self.ran, self.right = True, self.right or result == self.answer
        return result

    def get_reward(self) -> float:
        return 0.25 * self.ran + 0.25 * self.right


def evaluate(expression: str) -> str:
    """The expression's value as text: parsed, never evaluated as Python.

    >>> evaluate("123 * 45"), evaluate("7 / 2"), evaluate("-(2 + 3)")
    ('5535', '3.5', '-5')
    """
    def value(node):
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
