"""What exercise code may use, checked by reading it (``ast``), in the notebook and when grading.

First the constructs it is written with, against an allow-list (constructs.py); then the names. An
exercise is the learner's own code: it uses torch (``torch``, ``dist``, ``F``), ``math``, lablib's public
helpers (``lablib.all_reduce``, ``lablib.send``, ...) and the learner's own functions. It may not
import other modules, reach into private attributes or lablib's internals (where the answers live),
change library objects (``torch.allclose = ...``), or call the builtins that do any of that by name
(``getattr``, ``exec``, ``open``, ...). A task adds its own forbidden names: lab 02's rings may not
call library collectives, Task 2.1 may not use ``isend``.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import textwrap

from .allowed import MODULES as ALLOWED
from .constructs import construct

GLOBALS = {"torch", "dist", "F", "math", "lablib"}  # what every exercise namespace holds
_HELD = {"F": "torch.nn.functional"}  # the module a global name holds, where it is not its own name
SAFE_BUILTINS = {
    "abs", "all", "any", "bool", "callable", "dict", "divmod", "enumerate", "filter", "float", "format", "frozenset",
    "hasattr", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next", "object",
    "pow", "print", "range", "repr", "reversed", "round", "set", "slice", "sorted", "staticmethod", "str", "sum", "super",
    "tuple",
    "zip", "True", "False", "None", "NotImplemented", "Ellipsis",
    "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError", "NotImplementedError",
    "RuntimeError", "StopIteration", "TypeError", "ValueError", "ZeroDivisionError",
}
MODULES = {"torch", "torch.distributed", "torch.nn", "torch.nn.functional", "math", "lablib", "functools",
           "itertools", "collections"}
# Modules an attribute chain may pass through (torch.serialization.pickle leaves them: refused).
OWN_MODULES = ("torch", "math", "lablib", "functools", "itertools", "collections")
LABLIB_PUBLIC = ALLOWED["lablib"]  # lablib's helpers for exercises: the same list the guards hold grading to
TORCH_DENIED = {"save", "load", "hub", "utils", "ops", "classes", "jit", "library", "package", "multiprocessing",
                # the random state: a check's weights and inputs are drawn from seeds the code must not replay
                "manual_seed", "initial_seed", "seed", "get_rng_state", "set_rng_state", "random", "default_generator",
                "compile", "export", "fx", "overrides"}
# Attributes that lead from any object to modules, the interpreter or the process group's internals.
DENIED = {"sys", "os", "modules", "builtins", "importlib", "subprocess", "ctypes", "distributed_c10d", "group",
          "GroupMember", "attrgetter", "methodcaller", "globals", "f_globals", "f_back", "gi_frame",
          # ways to read or write files (a grading box's own request and results among them)
          "from_file", "numpy", "tofile", "checkpoint", "profiler", "onnx", "save_chrome_trace",
          "export_chrome_trace", "export_stacks", "export_memory_timeline",
          # functools' attribute copiers reach a library function's globals (its real builtins among them)
          "update_wrapper", "wraps"}

# What ``dist.*`` in a task's forbidden rules leaves allowed: questions, no data moved (labs 03-04, whose
# exercises communicate through lablib's traced collectives only).
DIST_QUERIES = {"get_rank", "get_world_size", "ReduceOp", "is_initialized", "get_backend", "get_group_rank",
                "get_process_group_ranks", "get_global_rank"}

# Collectives a ring must not call, with what to do instead (lab 02). A key starting with "~" matches
# any attribute that contains it (all_gather_coalesced, allgather, reduce_scatter_tensor, ...).
COLLECTIVES = {name: "build it from point-to-point messages, lablib.send/recv/exchange" for name in (
    "~gather", "~reduce", "~scatter", "~broadcast", "~all_to_all", "~alltoall", "~_object", "~coalesced",
    "dist.send", "dist.recv", "dist.isend", "dist.irecv", "batch_isend_irecv", "P2POp")}


def _forbidden_attr(attr: str, forbidden: dict) -> str | None:
    if attr in forbidden:
        return forbidden[attr]
    return next((why for key, why in forbidden.items() if key.startswith("~") and key[1:] in attr), None)


def _root(node) -> str | None:
    """``a`` for ``a.b.c`` (or ``a[0].b``), else None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def module_aliases(statements) -> dict[str, str]:
    """{name: module} that top-level ``statements`` (imports, assignments) bind, beyond the globals."""
    found = _aliases(ast.Module(body=list(statements), type_ignores=[]))
    return {k: v for k, v in found.items() if k not in GLOBALS}


def _binds(node) -> str | None:
    """The name ``node`` binds: a definition, a parameter, a target, an import, an exception's name."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return node.id
    if isinstance(node, ast.alias):
        return (node.asname or node.name).split(".")[0]
    if isinstance(node, ast.ExceptHandler) and node.name:
        return node.name
    return None


def bound_names(tree) -> set[str]:
    """Every name the code binds anywhere: definitions, parameters, targets, imports."""
    return {name for node in ast.walk(tree) if (name := _binds(node)) is not None}


# Builtins that reach past the rules (getattr, open, __import__, ...): code that binds one of these names
# (a parameter named __import__, say) would make its uses elsewhere look like the learner's own. Binding
# a harmless one (a parameter named input or bytes) is fine.
_HARMLESS = {"input", "id", "hash", "ord", "chr", "bin", "hex", "oct", "ascii", "bytes", "bytearray", "complex",
             "license", "copyright", "credits"}
_RESERVED = {name for name in dir(builtins) if name not in SAFE_BUILTINS | _HARMLESS}


def _is_path(node) -> bool:
    """``a`` or ``a.b.c``: a name or a chain of attributes (what can hold a module), not a call's result."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _module_of(node, modules: dict[str, str]) -> str | None:
    """The library module ``node`` holds, by what it is, however it is spelled (``F.torch.distributed``
    is torch.distributed): "dist" for torch.distributed (so a rule on ``dist.x`` holds for every
    spelling), else the module's name; None when it is no module."""
    path = _chain(node, modules)
    if not path:
        return None
    objects = list(_walk_chain(path))
    if len(objects) != len(path) or not inspect.ismodule(objects[-1]):
        return None
    name = objects[-1].__name__
    return "dist" if name == "torch.distributed" else name


def _chain(node, modules: dict[str, str]) -> list[str] | None:
    """``["torch", "distributed", "all_gather"]`` for an attribute chain rooted at a name that holds a
    library module, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in modules:
        return [modules[node.id]] + parts[::-1]
    return None


def _walk_chain(path: list[str]):
    """The objects each prefix of ``path`` names, starting from the real module (nothing is called)."""
    try:
        obj = importlib.import_module("torch.distributed" if path[0] == "dist" else path[0])
    except ImportError:
        return
    yield obj
    for attr in path[1:]:
        if attr.startswith("_"):
            return
        try:
            obj = getattr(obj, attr)
        except Exception:
            return
        yield obj


def _torch_attr(name: str):
    import torch

    return getattr(torch, name, _torch_attr)  # a stand-in no chain can reach, where torch has no such name


def _aliases(tree, outer: dict[str, str] | None = None) -> dict[str, str]:
    """{name: the library module it holds}: torch, dist, F, math, lablib, the names ``outer`` gives (the
    modules the learner's other cells bound), and every name bound here to one of them or to an
    attribute of one (``import lablib as L``, ``L = lablib``, ``nn = torch.nn``). Linear in the code's
    size: an assignment is read again only when the name it reads from gets a module."""
    out = {name: _HELD.get(name, name) for name in GLOBALS} | dict(outer or {})
    readers: dict[str, list] = {}  # name -> the assignments whose value is a path rooted at it
    todo = []
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Import):
            pairs = [((a.asname or a.name).split(".")[0],
                      "dist" if a.asname and a.name == "torch.distributed" else a.name.split(".")[0])
                     for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = "dist" if node.module == "torch.distributed" else node.module.split(".")[0]
            pairs = [(a.asname or a.name, "dist" if f"{node.module}.{a.name}" == "torch.distributed" else base)
                     for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None \
                and _is_path(node.value):
            readers.setdefault(_root(node.value), []).append(node)
        for name, module in pairs:
            out[name] = module
            todo.append(name)
    todo += [name for name in readers if name in out]
    changes: dict[str, int] = {}
    while todo:
        for node in readers.get(todo.pop(), ()):
            root = _root(node.value)
            held = "dist" if _module_of(node.value, out) == "dist" else out[root]
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                # a name bound to two modules settles on one: it may change a few times, not forever
                if out.get(name) != held and changes.get(name, 0) < 4:
                    out[name], changes[name] = held, changes.get(name, 0) + 1
                    todo.append(name)
    return out


def problems(tree: ast.AST, forbidden: dict[str, str] | None = None, defined: set[str] = frozenset(),
             outer: dict[str, str] | None = None) -> list[str]:
    """What in ``tree`` breaks the rules, one line each ([] when nothing does).

    ``forbidden``: {name, "module.name" or "~part of a name": what to do instead} for this task;
    ``defined``: names other exercise cells define (the learner's own helpers); ``outer``: those of them
    that hold library modules, and which (``from torch import distributed as D`` in another cell)."""
    forbidden = forbidden or {}
    bound = bound_names(tree)  # with ``defined``: the learner's own names (not copied: it may be large)
    modules = _aliases(tree, outer)  # names that hold library modules here, and which
    out = []

    def add(node, text):
        line = f"line {node.lineno}: " if hasattr(node, "lineno") else ""
        if f"{line}{text}" not in out:
            out.append(f"{line}{text}")

    # Where a module may stand: as the base of an attribute (lablib.all_gather) or bound by a plain
    # assignment (nn = torch.nn). Passed, stored, defaulted or looped over, it hides from these rules.
    bases = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    bases |= {id(n.value) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None
              and all(isinstance(t, ast.Name) for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))}
    stack = [tree]  # first the constructs: code written with one it may not use is read no further
    while stack:
        node = stack.pop()
        what = construct(node)
        if what is None:
            stack += ast.iter_child_nodes(node)
        else:
            add(node, f"uses {what}, which exercise code may not be written with (the exercises need only "
                      "functions, classes, loops, if, with, comprehensions and lambdas)")
    if out:
        return out
    for node in ast.walk(tree):
        name = _binds(node)
        if name is not None and (name in _RESERVED or (name.startswith("__") and name.endswith("__"))):
            add(node, f"binds the name {name}, which Python gives a meaning of its own; choose another name")
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            path = _chain(node, modules)
            if path:
                objects = list(_walk_chain(path))
                foreign = next((o for o in objects if inspect.ismodule(o)
                                and not o.__name__.split(".")[0] in OWN_MODULES), None)
                denied = next((name for name in TORCH_DENIED if any(o is _torch_attr(name) for o in objects[1:])), None)
                if denied is not None and path[1:] != [denied]:  # torch.save itself: the rule below says it
                    add(node, f"reaches torch.{denied} through {'.'.join(path)}, which an exercise does not need")
                elif foreign is not None:
                    add(node, f"reaches the module {foreign.__name__} through {'.'.join(path)}; exercises use "
                              "torch's, math's and lablib's own functions")
                elif id(node) not in bases and (isinstance(node, ast.Name) or
                                                 (len(objects) == len(path) and inspect.ismodule(objects[-1]))):
                    add(node, f"uses the module {'.'.join(path)} as a value; call its functions where you need "
                              f"them ({'.'.join(path)}.name(...))")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name not in MODULES:
                    add(node, f"imports {alias.name}; exercise code may import only {', '.join(sorted(MODULES))}")
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module not in MODULES:
                add(node, f"imports from {module}; exercise code may import only {', '.join(sorted(MODULES))}")
            for alias in node.names:
                if module == "lablib" and alias.name not in LABLIB_PUBLIC:
                    add(node, f"imports lablib.{alias.name}, which is not one of lablib's helpers for exercises "
                              f"({', '.join(sorted(LABLIB_PUBLIC))})")
                held = "dist" if module == "torch.distributed" else module
                why = (forbidden.get(f"{held}.{alias.name}") or _forbidden_attr(alias.name, forbidden)
                       or _dist_rule(held, alias.name, forbidden))
                if why or alias.name in DENIED:
                    add(node, f"imports {alias.name}: {why or 'an exercise does not need it'}")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            mine = node.id in bound or node.id in defined
            if node.id in forbidden and not mine:
                add(node, f"uses {node.id}: {forbidden[node.id]}")
            elif not mine and node.id not in GLOBALS and node.id not in SAFE_BUILTINS:
                add(node, f"uses {node.id}, which is neither yours, nor torch/dist/math/lablib, nor a plain builtin")
        elif isinstance(node, ast.Attribute):
            module = _module_of(node.value, modules)
            why = (_forbidden_attr(node.attr, forbidden) or (module and forbidden.get(f"{module}.{node.attr}"))
                   or _dist_rule(module, node.attr, forbidden))
            if node.attr.startswith("_"):
                add(node, f"uses the private attribute .{node.attr}")
            elif node.attr in DENIED:
                add(node, f"uses .{node.attr}, which an exercise does not need")
            if why:
                add(node, f"uses {module + '.' if module else '.'}{node.attr}: {why}")
            if module == "lablib" and node.attr not in LABLIB_PUBLIC:
                add(node, f"uses lablib.{node.attr}: exercises use lablib's helpers only "
                          f"({', '.join(sorted(LABLIB_PUBLIC))}), not its internals")
            if module in ("torch", "dist") and node.attr in TORCH_DENIED:
                add(node, f"uses {module}.{node.attr}, which an exercise does not need")
        if isinstance(node, ast.ClassDef):
            if node.keywords:
                add(node, f"gives class {node.name} keywords ({', '.join(k.arg or '**' for k in node.keywords)}): a "
                          "metaclass runs code of its own when the class is defined")
            for item in node.body:
                for name in sorted(top_names(item)):
                    if name.startswith("__") and name.endswith("__"):
                        add(item, f"defines {node.name}.{name}: a class in an exercise holds plain methods (an "
                                  "autograd Function's forward and backward), no hooks Python calls by itself")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, (ast.Attribute, ast.Subscript)) and _root(sub) in modules:
                        add(node, f"changes {ast.unparse(sub)}, part of a library; change only your own objects")
    return out


def _dist_rule(module, attr: str, forbidden: dict) -> str | None:
    """A task's ``dist.*`` rule: every member of torch.distributed but the questions (DIST_QUERIES)."""
    if module == "dist" and attr not in DIST_QUERIES and "dist.*" in forbidden:
        return forbidden["dist.*"]
    return None


def top_names(node) -> set[str]:
    """The names a statement of a module or class body binds: a definition its name, any other statement
    every name bound in it (targets, imports, loop variables, ``:=``)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    return bound_names(ast.Module(body=[node], type_ignores=[]))


def function_problems(fn, forbidden: dict[str, str] | None = None) -> list[str]:
    """The rules applied to a function defined in a notebook (its source, as IPython keeps it); a
    function whose source cannot be read is refused."""
    unreadable = ["has no source lablib can read (a lambda, a partial, or code made by exec): define it with `def` "
                  "in an exercise cell"]
    if not inspect.isfunction(fn) or fn.__name__ == "<lambda>":
        return unreadable
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return unreadable
    space = getattr(fn, "__globals__", {})
    defined = {name for name, value in space.items() if _learners(value, fn.__module__)}
    defined |= set(fn.__code__.co_freevars)  # helpers of a function defined inside another
    outer = {name: "dist" if space[name].__name__ == "torch.distributed" else space[name].__name__
             for name in defined & set(space) if inspect.ismodule(space[name])}
    return problems(tree, forbidden, defined, outer)


def _globals_read(code) -> set[str]:
    """The global names ``code`` reads (its nested functions' and comprehensions' too): not ``co_names``,
    which holds attribute names as well (``lablib.exchange`` is not the learner's own ``exchange``)."""
    import dis

    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _globals_read(const)
    return names


def reachable_problems(fn, forbidden: dict[str, str] | None = None) -> list[str]:
    """``function_problems`` of ``fn`` and of every function and class of its own module it reaches by
    name, directly or through others (a helper, lab 04's autograd Functions), each line prefixed with
    where it is: what grading's ``exercises._reachable`` reads, in the notebook."""
    out, seen, todo = [], set(), [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            todo += [getattr(m, "__func__", m) for m in vars(obj).values() if inspect.isfunction(getattr(m, "__func__", m))]
            continue
        found = function_problems(obj, forbidden)
        out += found if obj is fn else [f"({obj.__qualname__}) {p}" for p in found]
        if not found and inspect.isfunction(obj):
            names, space = _globals_read(obj.__code__), obj.__globals__
            todo += [space[n] for n in names if n in space and (inspect.isfunction(space[n]) or inspect.isclass(space[n]))
                     and getattr(space[n], "__module__", None) == fn.__module__]
    return out


def _learners(value, home: str) -> bool:
    """Whether a notebook global is the learner's to use: not lablib's (its functions, classes, objects,
    modules), not a module exercises may not import, and no function or class from elsewhere (an alias
    such as ``SDPA = F.scaled_dot_product_attention``, which grading refuses too): only those defined in
    the notebook itself (``home``, the exercise function's module)."""
    if inspect.ismodule(value):
        return value.__name__ in MODULES
    if inspect.isroutine(value) or inspect.isclass(value):
        return getattr(value, "__module__", None) == home
    owner = value if inspect.isfunction(value) or inspect.isclass(value) else type(value)
    module = getattr(owner, "__module__", "") or ""
    return not (module == "lablib" or module.startswith("lablib."))
