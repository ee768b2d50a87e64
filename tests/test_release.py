"""The real labs: learner copies are exactly what `lablib release` makes from the sources, and an
untouched learner copy fails its graded checks (with a message that helps) and nothing else."""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lablib.course.grade import _junit_results
from lablib.course.notebook import CHECK_OUTPUT, grade_info

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "sources").glob("*.ipynb"))


def test_committed_learner_copies_are_what_release_makes():
    out = subprocess.run([sys.executable, "-m", "lablib", "release", "--check", "sources", "labs"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert {p.name for p in (ROOT / "labs").glob("*.ipynb")} == {p.name for p in SOURCES}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_sources_keep_outputs_only_where_nbval_compares_them(source):
    nb = nbformat.read(source, as_version=4)
    assert "widgets" not in nb.metadata, "saved widget state (quiz answers included): run `lablib tidy`"
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        if CHECK_OUTPUT in cell.source:
            assert cell.outputs and cell.execution_count, f"cell {i}: run it and keep its output (lablib tidy)"
        else:
            assert not cell.outputs, f"cell {i} stores outputs nbval never compares: run `lablib tidy {source}`"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_untouched_learner_copy_fails_its_checks_and_only_them(source, tmp_path):
    learner = ROOT / "labs" / source.name
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    "--rootdir", str(ROOT), str(learner)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                   env={**__import__("os").environ, "LABLIB_ANSWERS": str(tmp_path / "quiz_answers.json")})
    results = _junit_results(junit)
    nb = nbformat.read(learner, as_version=4)
    assert "widgets" not in nb.metadata and "Your saved answer" not in learner.read_text()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(results) == len(code)
    for n, cell in enumerate(code):
        status, detail = results[(source.name, n)]
        if grade_info(cell):
            assert status == "failed", f"check cell {n} passed on an untouched copy"
            assert "is not done yet" in detail and "NotImplementedError" in detail, detail
        elif "quiz.score(" in cell.source:
            assert status == "failed"  # no answers yet, so the score differs from the full one
        else:
            assert status == "passed", f"cell {n} failed on an untouched copy:\n{detail}"
