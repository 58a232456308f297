"""The bundled task's ``calculate`` tool, in a module of its own so that a tool process imports nothing else."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**30:
            raise ValueError("the result is too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only whole numbers with + - * // % and parentheses")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers.

    Args:
        expression: The expression, e.g. "347 * 29" (+ - * // % and parentheses).
    """
    return str(_value(ast.parse(expression.strip(), mode="eval")))
