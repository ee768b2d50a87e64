"""The notebook format as the course uses it: the markers a source notebook carries, and reading a
notebook as plain JSON. Shared by release.py and grade.py.

- ``### BEGIN SOLUTION Task 1.2: what to do`` ... ``### END SOLUTION`` marks a solution region; the
  learner copy gets ``raise NotImplementedError("Task 1.2: what to do")`` in its place.
- ``### BEGIN HIDDEN CHECKS`` ... ``### END HIDDEN CHECKS`` marks checks the learner does not see; they
  run when grading with ``--source``.
- A graded cell carries ``{"lablib": {"grade_id": "check-1.2", "points": 2}}`` in its metadata.
- ``release`` tags an exercise cell of the learner copy ``{"lablib": {"exercise": ["Task 1.2: ..."]}}``:
  grading finds the learner's exercise code by it (course/exercises.py).
- A cell tagged ``source-only`` is dropped from the learner copy (e.g. the one recording the quiz key).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

BEGIN_SOLUTION = re.compile(r"^(\s*)### BEGIN SOLUTION\b\s*(.*)$")
END_SOLUTION = re.compile(r"^\s*### END SOLUTION\b")
BEGIN_HIDDEN = re.compile(r"^\s*### BEGIN HIDDEN CHECKS\b")
END_HIDDEN = re.compile(r"^\s*### END HIDDEN CHECKS\b")
CHECK_OUTPUT = "NBVAL_CHECK_OUTPUT"
SOURCE_ONLY = "source-only"
ANSWERS = "quiz_answers.json"



def grade_info(cell) -> dict | None:
    """``{"grade_id": ..., "points": ...}`` of a graded cell, else None."""
    info = cell.get("metadata", {}).get("lablib")
    return info if isinstance(info, dict) and "grade_id" in info else None


def read_notebook(path) -> dict:
    """A notebook as plain JSON, sources joined into strings. Grading reads notebooks this way: importing
    nbformat costs over a second here (its schema validator), paid again by every grading process."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path}: not a notebook (no list of cells)")
    for cell in nb["cells"]:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        cell.setdefault("metadata", {})
        if cell.get("cell_type") == "code":
            cell.setdefault("outputs", [])
    return nb
