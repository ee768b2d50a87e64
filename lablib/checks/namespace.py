"""The namespace exercise code runs in when graded, and the builtins it has there and on the ranks.

``lablib grade`` and ``python -m lablib.run`` execute the learner's exercise cells in ``namespace()``
(module name ``__exercise__``): torch, dist, F, math, lablib, and only the plain builtins (policy.py's
SAFE_BUILTINS) with an ``__import__`` that takes only the modules exercises may import. A function
shipped to a rank is rebuilt there by cloudpickle with the rank's real builtins; ``restrict`` gives the
exercise functions in a job the same restricted ones again, so the rules hold on the ranks too.
"""
from __future__ import annotations

import builtins
import functools
import math
import os
import sys
import types

from .policy import MODULES, SAFE_BUILTINS

NAME = "__exercise__"
# torch's C code imports its own modules through the calling frame's __import__, this one: torch.storage
# on a process's first torch.tensor(...).
_TORCH_OWN = {"torch.storage"}


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or (name not in MODULES and name not in _TORCH_OWN):
        raise ImportError(f"exercise code may import only {', '.join(sorted(MODULES))}, not {name}")
    return __import__(name, globals, locals, fromlist, level)


@functools.cache
def _builtins() -> types.MappingProxyType:
    safe = {name: getattr(builtins, name) for name in SAFE_BUILTINS if hasattr(builtins, name)}
    safe.update(__import__=_guarded_import, __build_class__=builtins.__build_class__)
    return types.MappingProxyType(safe)


def exercise_builtins() -> dict:
    """The builtins exercise code has: a fresh dict each time (code that changes it changes only its own)."""
    return dict(_builtins())


def namespace() -> dict:
    """A fresh namespace for exercise code: torch, dist, F (torch.nn.functional), math, lablib and the
    plain builtins only."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import lablib

    return {"__name__": NAME, "__builtins__": exercise_builtins(), "torch": torch, "dist": dist, "F": F,
            "math": math, "lablib": lablib}


def restrict(obj) -> None:
    """Give every exercise function reachable from ``obj`` (a job's function and arguments: in lists,
    tuples, dicts, closures, defaults, partials, bound methods and the learner's classes) the exercise
    builtins instead of this process's."""
    todo, seen, spaces = [obj], set(), {}
    while todo:
        item = todo.pop()
        if id(item) in seen or isinstance(item, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple, set, frozenset)):
            todo += item
        elif isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, (staticmethod, classmethod, types.MethodType)):
            todo.append(item.__func__)
        elif isinstance(item, functools.partial):
            todo += [item.func, *item.args, *item.keywords.values()]
        elif isinstance(item, types.FunctionType):
            if item.__module__ == NAME:
                spaces[id(item.__globals__)] = item.__globals__
                todo += item.__globals__.values()  # its helpers and classes
            todo += [c.cell_contents for c in item.__closure__ or () if _filled(c)] + list(item.__defaults__ or ())
        elif isinstance(item, type) and item.__module__ == NAME:
            todo += vars(item).values()
    for space in spaces.values():
        space["__builtins__"] = exercise_builtins()


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


# -- no processes from exercise code while grading ------------------------------------------------------
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                            "os.forkpty", "pty.spawn"})  # the audit events of starting a process


def exercise_frame() -> str | None:
    """The name of the exercise function (or cell) running on this thread's stack, if one is."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == NAME:
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def refuse_from_exercise(what: str) -> None:
    """Under grading (LABLIB_GRADING=1), a RuntimeError when exercise code is what asked for ``what``: a box
    holds one learner, and processes started from their code would take the CPU that their checks and the
    other boxes were given."""
    if os.environ.get("LABLIB_GRADING") != "1":
        return
    by = exercise_frame()
    if by is not None:
        raise RuntimeError(f"grading: exercise code may not start processes ({what}, from {by}()). The check runs "
                           "your functions on the ranks it needs; a rank pool of your own belongs in the "
                           "notebook's other cells, which grading does not run.")


def _audit(event: str, args) -> None:
    if event in PROCESS_EVENTS:
        refuse_from_exercise(event)


_GUARDED = [False]


def guard_processes() -> None:
    """Under grading: from now on, in this process and those it forks, starting a process from exercise code
    raises (an audit hook; it cannot be removed)."""
    if os.environ.get("LABLIB_GRADING") == "1" and not _GUARDED[0]:
        sys.addaudithook(_audit)
        _GUARDED[0] = True
