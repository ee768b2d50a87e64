"""What exercise code may use, checked by reading it (``ast``), in the notebook and when grading.

An exercise is the learner's own code: it uses torch (``torch``, ``dist``), ``math``, lablib's public
helpers (``lablib.all_reduce``, ``lablib.send``, ...) and the learner's own functions. It may not
import other modules, reach into private attributes or lablib's internals (where the answers live),
change library objects (``torch.allclose = ...``), or call the builtins that do any of that by name
(``getattr``, ``exec``, ``open``, ...). A task adds its own forbidden names: lab 02's rings may not
call library collectives, Task 2.1 may not use ``isend``.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

GLOBALS = {"torch", "dist", "math", "lablib"}  # what every exercise namespace holds
SAFE_BUILTINS = {
    "abs", "all", "any", "bool", "callable", "dict", "divmod", "enumerate", "filter", "float", "format", "frozenset",
    "hasattr", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next", "object",
    "pow", "print", "range", "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "super", "tuple",
    "type", "zip", "True", "False", "None", "NotImplemented", "Ellipsis",
    "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError", "NotImplementedError",
    "RuntimeError", "StopIteration", "TypeError", "ValueError", "ZeroDivisionError",
}
MODULES = {"torch", "torch.distributed", "torch.nn", "torch.nn.functional", "math", "lablib", "functools",
           "itertools", "operator", "typing", "collections"}
LABLIB_PUBLIC = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier", "send", "recv",
                 "isend", "irecv", "span", "device", "cluster", "Cluster", "RankError", "Timeline", "Span"}
TORCH_DENIED = {"save", "load", "hub", "utils", "ops", "classes", "jit", "library", "package", "multiprocessing",
                "compile", "export", "fx", "overrides"}

# Collectives a ring must not call, with what to do instead (lab 02).
COLLECTIVES = {name: "build it from point-to-point messages, lablib.send/recv/isend/irecv" for name in (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast", "all_to_all",
    "all_to_all_single", "scatter", "gather", "reduce", "dist.send", "dist.recv", "dist.isend", "dist.irecv",
    "batch_isend_irecv", "P2POp")}


def _root(node) -> str | None:
    """``a`` for ``a.b.c`` (or ``a[0].b``), else None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def bound_names(tree) -> set[str]:
    """Every name the code binds anywhere: definitions, parameters, targets, imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def problems(tree: ast.AST, forbidden: dict[str, str] | None = None, defined: set[str] = frozenset()) -> list[str]:
    """What in ``tree`` breaks the rules, one line each ([] when nothing does).

    ``forbidden``: {name or "module.name": what to do instead} for this task; ``defined``: names other
    exercise cells define (the learner's own helpers)."""
    forbidden = forbidden or {}
    bound = bound_names(tree) | set(defined)
    modules = set(GLOBALS)  # names that hold library modules here
    out = []

    def add(node, text):
        line = f"line {node.lineno}: " if hasattr(node, "lineno") else ""
        if f"{line}{text}" not in out:
            out.append(f"{line}{text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in MODULES:
                    add(node, f"imports {alias.name}; exercise code may import only {', '.join(sorted(MODULES))}")
                modules.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module not in MODULES:
                add(node, f"imports from {module}; exercise code may import only {', '.join(sorted(MODULES))}")
            for alias in node.names:
                if module == "lablib" and alias.name not in LABLIB_PUBLIC:
                    add(node, f"imports lablib.{alias.name}, which is not one of lablib's helpers for exercises "
                              f"({', '.join(sorted(LABLIB_PUBLIC))})")
                if alias.name in forbidden or f"{module}.{alias.name}".replace("torch.distributed", "dist") in forbidden:
                    key = alias.name if alias.name in forbidden else f"dist.{alias.name}"
                    add(node, f"imports {alias.name}: {forbidden[key]}")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in forbidden and node.id not in bound:
                add(node, f"uses {node.id}: {forbidden[node.id]}")
            elif node.id not in bound and node.id not in GLOBALS and node.id not in SAFE_BUILTINS:
                add(node, f"uses {node.id}, which is neither yours, nor torch/dist/math/lablib, nor a plain builtin")
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_"):
                add(node, f"uses the private attribute .{node.attr}")
            if node.attr in forbidden:
                add(node, f"uses .{node.attr}: {forbidden[node.attr]}")
            elif isinstance(node.value, ast.Name) and f"{node.value.id}.{node.attr}" in forbidden:
                add(node, f"uses {node.value.id}.{node.attr}: {forbidden[f'{node.value.id}.{node.attr}']}")
            if isinstance(node.value, ast.Name) and node.value.id == "lablib" and node.attr not in LABLIB_PUBLIC:
                add(node, f"uses lablib.{node.attr}: exercises use lablib's helpers only "
                          f"({', '.join(sorted(LABLIB_PUBLIC))}), not its internals")
            if isinstance(node.value, ast.Name) and node.value.id in ("torch", "dist") and node.attr in TORCH_DENIED:
                add(node, f"uses {node.value.id}.{node.attr}, which an exercise does not need")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, (ast.Attribute, ast.Subscript)) and _root(sub) in modules:
                        add(node, f"changes {ast.unparse(sub)}, part of a library; change only your own objects")
    return out


def function_problems(fn, forbidden: dict[str, str] | None = None) -> list[str]:
    """The rules applied to a function defined in a notebook (its source, as IPython keeps it); [] when
    the source cannot be found."""
    if getattr(fn, "__name__", "") == "<lambda>":  # its source is the line around it: nothing to read
        return []
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    defined = {name for name, value in getattr(fn, "__globals__", {}).items() if _learners(value)}
    defined |= set(fn.__code__.co_freevars)  # helpers of a function defined inside another
    return problems(tree, forbidden, defined)


def _learners(value) -> bool:
    """Whether a notebook global is the learner's to use: not lablib's (its functions, classes, objects,
    modules), not a module exercises may not import."""
    if inspect.ismodule(value):
        return value.__name__ in MODULES
    owner = value if inspect.isfunction(value) or inspect.isclass(value) else type(value)
    module = getattr(owner, "__module__", "") or ""
    return not (module == "lablib" or module.startswith("lablib."))
