"""A numeric question's key as arithmetic on its inputs, and its texts' figures from the same inputs.

A numeric question names its inputs (``given: {tokens: 4096, k: 2}``) and its key as an expression of
them (``key: tokens * k / 8``); its texts write figures as ``{expression}`` or ``{expression:format}``
(``{tokens:,}`` is 4,096; ``{tokens * k / 1e6:.2f}``), and its explanation may write ``{key}``, the
computed answer. So a key cannot disagree with the arithmetic its explanation shows: both are computed
from one set of inputs. ``{{`` and ``}}`` write a brace.

Expressions are arithmetic only (numbers, the inputs, + - * / // % **, parentheses and the functions in
``FUNCTIONS``), evaluated here without ``eval``.
"""
from __future__ import annotations

import ast
import math
import operator
import re

FUNCTIONS = {"ceil": math.ceil, "floor": math.floor, "sqrt": math.sqrt, "log2": math.log2, "min": min,
             "max": max, "abs": abs, "round": round}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")


class ArithError(ValueError):
    """An expression or a text's figure that cannot be computed; the message says why."""


def evaluate(expression: str, names: dict) -> float:
    """The value of an arithmetic ``expression`` over ``names``; raises ArithError."""
    if not isinstance(expression, str) or not expression.strip():
        raise ArithError(f"expected an arithmetic expression, got {expression!r}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ArithError(f"{expression!r} is not an arithmetic expression") from None
    try:
        value = _value(tree.body, names)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:
        raise ArithError(f"{expression!r}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ArithError(f"{expression!r} is {value!r}, not a finite number")
    return value


def _value(node, names):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            known = ", ".join(sorted(names)) or "none"
            raise ArithError(f"unknown name {node.id!r} (the inputs in 'given': {known})")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left, names), _value(node.right, names))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, names))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        return FUNCTIONS[node.func.id](*(_value(a, names) for a in node.args))
    raise ArithError(f"{ast.unparse(node)!r} is not allowed: numbers, inputs, + - * / // % ** and "
                     f"{', '.join(FUNCTIONS)} only")


def render(text: str, names: dict) -> str:
    """``text`` with each ``{expression}`` or ``{expression:format}`` replaced by its value; raises ArithError.
    Without a format a whole number is written as one (4096), another number as ``:g`` writes it."""
    def field(m):
        if m.group(0) in ("{{", "}}"):
            return m.group(0)[0]
        expression, _, spec = m.group(1).partition(":")
        value = evaluate(expression, names)
        if not spec:
            return str(int(value)) if float(value).is_integer() else f"{value:g}"
        try:
            return format(value, spec)
        except ValueError as e:
            raise ArithError(f"{{{m.group(1)}}}: format {spec!r}: {e}") from None

    rendered = _FIELD.sub(field, text)
    if "{" in _FIELD.sub("", text) or "}" in _FIELD.sub("", text):
        raise ArithError("a lone '{' or '}' (write {{ or }} for a brace)")
    return rendered


def decimals(number) -> int:
    """How many decimals ``number`` is written with in a bank (58.72: 2; 160: 0)."""
    text = repr(number)
    if "e" in text or "E" in text:
        mantissa, _, exponent = text.lower().partition("e")
        return max(0, len(mantissa.partition(".")[2]) - int(exponent))
    return len(text.partition(".")[2].rstrip("0")) if "." in text else 0
