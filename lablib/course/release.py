"""Release: the learner copies of the source notebooks (``lablib release``).

Solutions become stubs, hidden checks and source-only cells are removed, and outputs are stripped
except where nbval compares them (cells marked ``# NBVAL_CHECK_OUTPUT``). The markers are described in
notebook.py.
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
            if tasks:
                pending_exercise = index
        cells.append(cell)
    if pending_exercise is not None:
        raise ReleaseError(f"{name}: the exercise in cell {pending_exercise} must be followed by a graded check cell")
    code = [c for c in cells if c["cell_type"] == "code"]
    if code and "quiz.score(" not in code[-1]["source"]:
        raise ReleaseError(f"{name}: the last code cell must be the quiz score cell (lablib.quiz.score(...))")
    nb["cells"] = cells
    return tidy(nb)


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


def release(source_dir, out_dir, check: bool = False) -> list[str]:
    """Write the learner copy of every notebook in ``source_dir`` to ``out_dir``.

    With ``check=True`` nothing is written; the names of copies that differ are returned."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    sources = sorted(source_dir.glob("*.ipynb"))
    if not sources:
        raise ReleaseError(f"{source_dir}: no notebooks to release")
    differ = []
    for path in sources:
        import nbformat  # the canonical formatting, so committed copies diff cleanly

        learner = release_notebook(nbformat.read(path, as_version=4), path.name)
        text = nbformat.writes(learner) + "\n"
        target = out_dir / path.name
        if check:
            if not target.exists() or target.read_text() != text:
                differ.append(path.name)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    return differ


# -- grade -------------------------------------------------------------------------------------------
