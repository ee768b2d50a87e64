"""Release: the learner copies of the source notebooks (``lablib release``).

Solutions become stubs, hidden checks and source-only cells are removed, and so are every output and
the ``# NBVAL_CHECK_OUTPUT`` marker lines: a learner copy carries nothing the solved source printed (the
source keeps its markers and outputs, so nbval still compares them there). The markers are described
in notebook.py.

With ``quiz="exam"`` the release also writes keyless copies of the quiz banks (no answers, tolerances,
explanations or hints; marked ``mode: exam``) to a folder that becomes the learner copy's ``quizzes/``.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

from .notebook import (BEGIN_HIDDEN, BEGIN_SOLUTION, CHECK_OUTPUT, END_HIDDEN, END_SOLUTION, SOURCE_ONLY,
                       grade_info)


class ReleaseError(ValueError):
    pass


def _strip_regions(source: str, where: str, keep_hidden: bool) -> tuple[str, list[str]]:
    """The learner's version of a cell's source, and the tasks whose solutions were stubbed."""
    out, tasks = [], []
    lines = source.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = BEGIN_SOLUTION.match(line)
        if m:
            indent, task = m.group(1), m.group(2).strip()
            if not re.match(r"Task \d+\.\d+", task):
                raise ReleaseError(f"{where}, line {i + 1}: name the task after BEGIN SOLUTION, e.g. "
                                   "'### BEGIN SOLUTION Task 1.2: pad the flat buffer'")
            j = next((k for k in range(i + 1, len(lines)) if END_SOLUTION.match(lines[k])), None)
            if j is None:
                raise ReleaseError(f"{where}, line {i + 1}: BEGIN SOLUTION without END SOLUTION")
            out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError({task!r})"]
            tasks.append(task)
            i = j + 1
            continue
        if BEGIN_HIDDEN.match(line):
            j = next((k for k in range(i + 1, len(lines)) if END_HIDDEN.match(lines[k])), None)
            if j is None:
                raise ReleaseError(f"{where}, line {i + 1}: BEGIN HIDDEN CHECKS without END HIDDEN CHECKS")
            if keep_hidden:
                out += lines[i + 1:j]
            i = j + 1
            continue
        if END_SOLUTION.match(line) or END_HIDDEN.match(line):
            raise ReleaseError(f"{where}, line {i + 1}: END marker without its BEGIN")
        out.append(line)
        i += 1
    return "\n".join(out), tasks


def release_notebook(nb, name: str = "notebook", keep_hidden: bool = False):
    """The learner copy of a source notebook (a new NotebookNode); raises ReleaseError on bad markers."""
    nb = copy.deepcopy(nb)
    cells, seen_ids = [], {}
    pending_exercise = None
    for index, cell in enumerate(nb["cells"]):
        where = f"{name}: cell {index}"
        if SOURCE_ONLY in cell.get("metadata", {}).get("tags", []):
            continue
        info = grade_info(cell)
        if info is not None:
            gid = info["grade_id"]
            if gid in seen_ids:
                raise ReleaseError(f"{where}: grade_id {gid!r} is also used by cell {seen_ids[gid]}")
            seen_ids[gid] = index
            if not (isinstance(info.get("points"), (int, float)) and info["points"] > 0):
                raise ReleaseError(f"{where}: graded cell {gid!r} needs points > 0")
        if cell["cell_type"] == "code":
            if pending_exercise is not None and info is None:
                raise ReleaseError(f"{name}: the exercise in cell {pending_exercise} must be followed by a graded "
                                   f"check cell (cell {index} has no lablib.grade_id)")
            pending_exercise = None
            cell["source"], tasks = _strip_regions(cell["source"], where, keep_hidden)
            if tasks:  # grading finds the exercise cells by this tag (course/exercises.py)
                cell["metadata"]["lablib"] = {"exercise": sorted(set(tasks))}
                pending_exercise = index
        cells.append(cell)
    if pending_exercise is not None:
        raise ReleaseError(f"{name}: the exercise in cell {pending_exercise} must be followed by a graded check cell")
    code = [c for c in cells if c["cell_type"] == "code"]
    if code and "quiz.score(" not in code[-1]["source"]:
        raise ReleaseError(f"{name}: the last code cell must be the quiz score cell (lablib.quiz.score(...))")
    for cell in code:
        cell["source"] = _CHECK_OUTPUT_LINE.sub("", cell["source"])
    nb["cells"] = cells
    return tidy(nb)


_CHECK_OUTPUT_LINE = re.compile(rf"^[ \t]*#[ \t]*{CHECK_OUTPUT}[ \t]*(\n|$)", re.M)


def tidy(nb):
    """Outputs only where nbval compares them (``# NBVAL_CHECK_OUTPUT`` cells, numbered so nbval treats
    them as run); no execution counts or timing metadata elsewhere, and no saved widget state (it is
    stale, large, and would show a learner the quiz answers of whoever ran the notebook). In place;
    returns ``nb``."""
    nb["metadata"].pop("widgets", None)
    count = 0
    for cell in nb["cells"]:
        for key in ("execution", "collapsed", "scrolled", "ExecuteTime"):
            cell.get("metadata", {}).pop(key, None)
        if cell["cell_type"] != "code":
            continue
        count += 1
        keep = CHECK_OUTPUT in cell["source"]
        cell["outputs"] = cell["outputs"] if keep else []
        cell["execution_count"] = count if keep else None
        for out in cell["outputs"]:
            if "execution_count" in out:
                out["execution_count"] = count
    return nb


def release(source_dir, out_dir, check: bool = False, quiz: str = "practice", banks_dir=None,
            banks_out=None) -> list[str]:
    """Write the learner copy of every notebook in ``source_dir`` to ``out_dir``.

    ``quiz="exam"`` also writes keyless copies of the banks in ``banks_dir`` (default: the banks lablib
    reads, ``$LABLIB_QUIZZES`` or ``quizzes/``) to ``banks_out`` (default: ``quizzes`` beside
    ``out_dir``), never over ``banks_dir`` itself. With ``check=True`` nothing is written; the names of
    files that differ are returned."""
    from ..quiz.bank import default_dir

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if quiz not in ("practice", "exam"):
        raise ReleaseError(f"quiz mode {quiz!r}: use practice or exam")
    sources = sorted(source_dir.glob("*.ipynb"))
    if not sources:
        raise ReleaseError(f"{source_dir}: no notebooks to release")
    files = {}
    if quiz == "exam":
        banks_dir = Path(banks_dir) if banks_dir is not None else default_dir()
        banks_out = Path(banks_out) if banks_out is not None else out_dir.parent / "quizzes"
        if banks_out.resolve() == banks_dir.resolve():
            raise ReleaseError(f"{banks_out} holds the keyed quiz banks: an exam release there would overwrite "
                               "their answer keys. Release into another folder (e.g. lablib release --quiz exam "
                               "sources COPY/labs, which writes COPY/quizzes) or pass --banks-out DIR.")
        files.update({banks_out / f"{b.id}.yaml": keyless_bank(b.path) for b in _keyed_banks(banks_dir)})
    import nbformat  # the canonical formatting, so committed copies diff cleanly

    for path in sources:
        learner = release_notebook(nbformat.read(path, as_version=4), path.name)
        files[out_dir / path.name] = nbformat.writes(learner) + "\n"
    differ = []
    for target, text in files.items():
        if check:
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                differ.append(target.name)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    return differ


def _keyed_banks(folder: Path):
    from ..quiz.bank import QuizError, load_all

    try:
        banks = load_all(folder)
    except QuizError as e:
        raise ReleaseError("the quiz banks have problems (lablib quiz check):\n" + str(e)) from None
    keyless = [b.path.name for b in banks.values() if not b.keyed]
    if keyless:
        raise ReleaseError(f"{folder}: {', '.join(keyless)} are already keyless exam copies; release from the "
                           "instructor's keyed banks (set LABLIB_QUIZZES to them, or run in the course repository)")
    return banks.values()


def keyless_bank(path) -> str:
    """The exam copy of a bank, as YAML: ``mode: exam``, and no answers, tolerances, explanations or hints."""
    import yaml

    from ..quiz.bank import KEY_FIELDS, QuizError, validate

    path = Path(path)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    exam = {"id": data["id"], "mode": "exam", **{k: v for k, v in data.items() if k not in ("id", "mode")}}
    exam["questions"] = [{k: v for k, v in q.items() if k not in KEY_FIELDS} for q in data["questions"]]
    text = (f"# Exam copy of {path.name}, written by `lablib release --quiz exam`: no answer key, explanations\n"
            "# or hints. Answers are saved, not judged; the instructor grades them with the keyed bank.\n"
            + yaml.safe_dump(exam, allow_unicode=True, sort_keys=False, width=100))
    try:
        validate(yaml.safe_load(text), path)
    except QuizError as e:  # a release must never publish a bank lablib cannot load
        raise ReleaseError(f"the exam copy of {path.name} does not load:\n{e}") from None
    return text


# -- grade -------------------------------------------------------------------------------------------
