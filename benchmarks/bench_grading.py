"""Grading a learner's full course vs running the course once, side by side on this machine.

    python benchmarks/bench_grading.py [--rounds 2]

Target: grading one learner takes at most the time of running the course once plus 20%. "Running the
course" is `pytest --nbval-lax sources` (every lab, solved); the learner is a fully solved copy
of the same labs with the answer key, graded with `lablib grade --release labs --source sources`.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from lablib import quiz
from lablib.course.notebook import SOURCE_ONLY

ROOT = Path(__file__).resolve().parents[1]


def run_course() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "sources"], cwd=ROOT,
                   check=True, capture_output=True)
    return time.perf_counter() - t


def grade_learner(subs: Path, out: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lablib", "grade", str(subs), "--release", "labs", "--source",
                    "sources", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    learner = tmp / "subs" / "learner"
    learner.mkdir(parents=True)
    for src in sorted((ROOT / "sources").glob("*.ipynb")):
        nb = nbformat.read(src, as_version=4)
        nb.cells = [c for c in nb.cells if SOURCE_ONLY not in c.metadata.get("tags", [])]
        nbformat.write(nb, learner / src.name)
        quiz.solve(src.stem, quiz.AnswerStore(learner / "quiz_answers.json"))
    course, graded = [], []
    for _ in range(args.rounds):  # interleaved, so load on the machine hits both alike
        course.append(run_course())
        graded.append(grade_learner(tmp / "subs", tmp / "gradebook.csv"))
    total = [line for line in (tmp / "gradebook.csv").read_text().splitlines() if ",TOTAL," in line]
    c, g = statistics.median(course), statistics.median(graded)
    print(f"labs: {', '.join(p.stem for p in sorted((ROOT / 'sources').glob('*.ipynb')))}")
    print(f"running the course once (pytest --nbval-lax sources): {c:6.1f} s  (runs: {', '.join(f'{x:.1f}' for x in course)})")
    print(f"grading one learner (lablib grade):                       {g:6.1f} s  (runs: {', '.join(f'{x:.1f}' for x in graded)})")
    print(f"ratio: {g / c:.2f}  (target <= 1.20)")
    print("gradebook totals:", "; ".join(total))


if __name__ == "__main__":
    main()
