"""lablib's answers to the labs' tasks, one module per lab (lab00.py, lab01.py, ...), apart from the harness.

Each module's ``TASKS`` maps a task id to the names of its answer functions (those its stubs ask for, and
the helpers they define), so every task's answer is registered in one place. The harness (pool, comm,
strategies, the checks' rank jobs) never imports this package: a lab's measurements and the judges, which
run outside the grading box, do (the judges lazily, through ``checks.answers``). The box that grades a
lab mounts an empty folder here (``course.grade.box_mounts``), so code run in it finds no answer to
call, and a rank job that needs an answer's output (a schedule, a weight's shard) is given it as data,
computed outside (``Check.given``). An earlier lab's answer may still be a later lab's harness (lab 03
builds on lab 01's flat buffers); where it is, the harness holds its own code for it.
"""
from __future__ import annotations

import importlib


def registered(lab: str) -> dict[str, dict[str, object]]:
    """{task id: {name: answer}} of lab ``lab`` (e.g. "lab03")."""
    module = importlib.import_module(f"{__name__}.{lab}")
    return {task: {name: getattr(module, name) for name in names} for task, names in module.TASKS.items()}
