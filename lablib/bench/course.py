"""The whole course's claims: its source notebooks under nbval (P2), and grading a learner who solved
every lab against running the course once (P8)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..paths import ROOT
from .rows import Row, Settings


def _course_seconds() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "sources"], cwd=ROOT,
                   check=True, capture_output=True, env={**os.environ, "LABLIB_QUICK": "1"})
    return time.perf_counter() - t


def p2_course(s: Settings) -> list[Row]:
    return [Row("P2", "the whole course under nbval (sources/, LABLIB_QUICK=1)", "s", [_course_seconds()],
                target="", note="once")]


def p8_grading(s: Settings, course: list[float] | None = None) -> list[Row]:
    import nbformat

    from .. import quiz
    from ..course.key import solve
    from ..course.notebook import SOURCE_ONLY

    with tempfile.TemporaryDirectory(prefix="lablib-bench-") as tmp:
        learner = Path(tmp) / "subs" / "learner"
        learner.mkdir(parents=True)
        for src in sorted((ROOT / "sources").glob("*.ipynb")):
            nb = nbformat.read(src, as_version=4)
            nb.cells = [c for c in nb.cells if SOURCE_ONLY not in c.metadata.get("tags", [])]
            nbformat.write(nb, learner / src.name)
            solve(src.stem, quiz.AnswerStore(learner / "quiz_answers.json"))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lablib", "grade", str(Path(tmp) / "subs"), "--source", "sources",
                        "--out", str(Path(tmp) / "gradebook.csv")], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "LABLIB_QUICK": "1"})
        graded = time.perf_counter() - t
    row = Row("P8", "grading one fully solved learner (lablib grade)", "s", [graded], course or [_course_seconds()],
              "running the course once (P2)", "<= 1.2 x", note="once")
    row.met = row.ratio <= 1.2
    return [row]
