"""What exercise code may be written with: the Python constructs the labs' exercises need, and no more.

policy.py reads exercise code against this list before its rules on names: a construct that is not
here (``match``, ``try``, ``global``, ``yield``, ``async``, ``:=``, ...) is refused by name, whatever it
is used for. A construct joins the list when a lab's exercise needs it, never because no attack
through it is known yet.
"""
from __future__ import annotations

import ast

# What the exercises need: functions; autograd Functions as classes; loops, comprehensions, lambdas;
# `with torch.no_grad()`; assert and raise; f-strings for messages.
ALLOWED = frozenset({
    ast.Module, ast.FunctionDef, ast.ClassDef, ast.Return, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete,
    ast.For, ast.While, ast.If, ast.With, ast.Raise, ast.Assert, ast.Import, ast.ImportFrom, ast.Nonlocal,
    ast.Expr, ast.Pass, ast.Break, ast.Continue,
    ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Lambda, ast.IfExp, ast.Dict, ast.Set, ast.ListComp, ast.SetComp,
    ast.DictComp, ast.GeneratorExp, ast.Compare, ast.Call, ast.FormattedValue, ast.JoinedStr, ast.Constant,
    ast.Attribute, ast.Subscript, ast.Starred, ast.Name, ast.List, ast.Tuple, ast.Slice,
    ast.arguments, ast.arg, ast.keyword, ast.alias, ast.comprehension, ast.withitem,
    ast.Load, ast.Store, ast.Del,
    *(c for base in (ast.operator, ast.boolop, ast.unaryop, ast.cmpop) for c in base.__subclasses__()),
})
_CONSTRUCTS = {"Match": "a match statement", "Try": "try/except", "TryStar": "try/except*", "Global": "global",
               "Yield": "yield (a generator)", "YieldFrom": "yield from (a generator)", "Await": "await",
               "AsyncFunctionDef": "async def", "AsyncFor": "async for", "AsyncWith": "async with",
               "NamedExpr": "an assignment expression (:=)", "TypeAlias": "a type statement"}


def construct(node) -> str | None:
    """What ``node`` is, in words, when exercise code may not be written with it; None when it may."""
    if type(node) in ALLOWED:
        return None
    name = type(node).__name__
    return _CONSTRUCTS.get(name, f"the construct {name}")
