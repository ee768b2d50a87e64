"""lablib's answers (lablib/answers/): every task registers its answer functions, and the box that grades a
lab holds none of them: code in the box that imports every module of the lablib it sees finds no answer,
under any name (functions are compared by what they compute, ``answers.fingerprint``), while the same
code outside the box finds every one (so the search can find them)."""
import importlib
import inspect
import json
import shutil
import subprocess
import sys
import types

import pytest

from lablib.answers import registered
from lablib.checks import Check
from lablib.course import box as grading_box
from lablib.course import sandbox
from lablib.labs import LABS
from procs import HUNG
from test_sandbox import box  # noqa: F401 (the fixture)


def code_of(obj) -> list[types.CodeType]:
    """The code objects that make ``obj``: a function's, or each method a class defines itself (and the
    classes defined inside it)."""
    if inspect.isclass(obj):
        out = []
        for v in vars(obj).values():
            v = getattr(v, "__func__", getattr(v, "fget", v))  # static and class methods, properties
            if isinstance(v, types.FunctionType) or (inspect.isclass(v) and v.__qualname__.startswith(obj.__qualname__ + ".")):
                out += code_of(v)
        return out
    code = getattr(obj, "__code__", None)
    return [code] if isinstance(code, types.CodeType) else []


def fingerprint(code: types.CodeType) -> str:
    """What a function computes, whatever its name, file or docstring: its bytecode, constants but strings
    (nested code by its own fingerprint) and the names it uses. The same body anywhere has the same one."""
    consts = tuple(fingerprint(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts
                   if not isinstance(c, str))
    return repr((code.co_code, consts, code.co_names, code.co_varnames[:code.co_argcount]))


HEAD = "import importlib, inspect, json, pathlib, sys, types\n"
# Then, with code_of and fingerprint: imports every module of the lablib it finds and writes what it found
# to the file argv[2]: the modules that failed to import (and why), and the fingerprint of every function
# there, nested ones and classes' methods included.
SEARCH = r"""
import lablib

labs = json.loads(sys.argv[1])
root = pathlib.Path(lablib.__file__).parent  # every .py file (a folder without __init__.py is a package too)
names = [".".join(("lablib",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
         for p in sorted(root.rglob("*.py")) if p.stem != "__main__"]
names += [f"lablib.answers.{lab}" for lab in labs]
failed, found = {}, set()

def codes(code):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from codes(c)

def look(value, depth=0):
    if isinstance(value, (list, tuple)) and depth < 2:
        for v in value:
            look(v, depth + 1)
    elif isinstance(value, dict) and depth < 2:
        for v in value.values():
            look(v, depth + 1)
    elif callable(value) or isinstance(value, type):
        for code in code_of(value):
            found.update(fingerprint(c) for c in codes(code))
    elif hasattr(value, "__dict__") and not isinstance(value, types.ModuleType) and depth < 2:
        look(dict(vars(value)), depth + 1)

for name in dict.fromkeys(names):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
        continue
    for value in list(vars(module).values()):
        look(value)
with open(sys.argv[2], "w") as f:
    json.dump({"failed": failed, "found": sorted(found)}, f)
"""


def answer_prints(lab: str) -> set[str]:
    return {fingerprint(c) for fns in registered(lab).values() for fn in fns.values() for c in code_of(fn)}


def test_every_task_registers_its_answers_and_every_check_takes_registered_functions():
    for lab in LABS:
        module = importlib.import_module(f"lablib.checks.{lab.checks}")
        checks = [c for c in vars(module).values() if isinstance(c, Check)]
        answers = registered(lab.checks)
        assert sorted(answers) == sorted({c.task for c in checks}), lab.checks
        names = {name for fns in answers.values() for name in fns}
        for check in checks:  # a check runs the learner's functions of its own task or an earlier one of the lab
            assert set(check.params) <= names, (check.task, set(check.params) - names)
            assert set(check.params) & set(answers[check.task]), check.task
        assert all(answer_prints(lab.checks)), lab.checks


def test_the_grading_box_holds_no_lab_answers(box, tmp_path):  # noqa: F811
    """Not even those a lab builds on (lab 08 runs lab 04's and lab 05's): those come as data
    (tests/test_grading_evidence.py grades lab 08 from its release)."""
    labs = [lab.checks for lab in LABS]
    work = tmp_path / "work"
    work.mkdir()
    argv = [sys.executable, "-c", HEAD + inspect.getsource(code_of) + inspect.getsource(fingerprint) + SEARCH,
            json.dumps(labs), str(work / "found.json")]
    subprocess.run(argv, timeout=HUNG, check=True)
    seen = json.loads((work / "found.json").read_text())
    assert seen["failed"] == {}
    (work / "found.json").unlink()
    folder = grading_box.answers_folder()
    try:
        run = sandbox.run(argv, workdir=work, **grading_box.box_view(folder), limits=sandbox.Limits(HUNG))
    finally:
        shutil.rmtree(folder)
    assert run.returncode == 0 and run.boxed, run.output
    inside = json.loads((work / "found.json").read_text())
    # every lab's answers are missing in the box, and nothing else is
    assert sorted(inside["failed"]) == sorted(f"lablib.answers.{lab}" for lab in labs), inside["failed"]
    assert all("ModuleNotFoundError" in why for why in inside["failed"].values())
    for lab in labs:
        prints = answer_prints(lab)
        assert prints <= set(seen["found"]), lab  # outside, the search finds every answer...
        assert not prints & set(inside["found"]), lab  # ...inside none: no copy under another name either
