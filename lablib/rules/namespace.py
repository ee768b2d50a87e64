"""The namespace exercise code runs in when graded, and the builtins it has there and on the ranks.

``lablib grade`` and ``python -m lablib.run`` execute the learner's exercise cells in ``namespace()``
(module name ``__exercise__``): torch, dist, F, math, lablib, and only the plain builtins (policy.py's
SAFE_BUILTINS) with an ``__import__`` that takes only the modules exercises may import, and the hooks that
code compiled with the guards calls (guards.py: grading compiles it so). A function shipped to a rank is
rebuilt there by cloudpickle, which would give it the rank's real builtins; under grading the rank has it rebuilt
with the exercise builtins instead (``rebuild_with_exercise_builtins``), so the rules hold on the ranks too.
"""
from __future__ import annotations

import builtins
import functools
import math
import os
import sys
import types

from .guards import GUARDS, NAME
from .policy import SAFE_BUILTINS


@functools.cache
def _builtins() -> types.MappingProxyType:
    safe = {name: getattr(builtins, name) for name in SAFE_BUILTINS if hasattr(builtins, name)}
    safe.update(GUARDS, __build_class__=builtins.__build_class__)  # guarded code's hooks, __import__, hasattr
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
            "math": math, "lablib": lablib, **GUARDS}


def _make_function(code, globals, name, argdefs, closure):
    """cloudpickle's ``_make_function``, giving an exercise function the exercise builtins."""
    globals["__builtins__"] = exercise_builtins() if globals.get("__name__") == NAME else builtins.__dict__
    return types.FunctionType(code, globals, name, argdefs, closure)


def rebuild_with_exercise_builtins() -> None:
    """From now on in this process (a rank under grading), every exercise function cloudpickle rebuilds gets the
    exercise builtins. A function's builtins are fixed when it is made (CPython 3.10+), so they must be given
    then: setting its globals' ``__builtins__`` afterwards changes nothing."""
    import cloudpickle.cloudpickle as cp

    cp._make_function = _make_function


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
