"""The real labs: learner copies are exactly what `lablib release` makes from the sources, and an
untouched learner copy fails its graded checks (with a message that helps) and nothing else."""
import subprocess
import sys
from pathlib import Path

import learner_copies
import nbformat
import pytest

from lablib.course.notebook import CHECK_OUTPUT, grade_info

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "sources").glob("*.ipynb"))


def test_committed_learner_copies_are_what_release_makes():
    out = subprocess.run([sys.executable, "-m", "lablib", "release", "--check", "sources", "labs"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert {p.name for p in (ROOT / "labs").glob("*.ipynb")} == {p.name for p in SOURCES}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_learner_copies_carry_no_outputs_and_no_nbval_markers(source):
    nb = nbformat.read(ROOT / "labs" / source.name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "quiz.score(" in code[-1].source
    for i, cell in enumerate(code):
        assert not cell.outputs and cell.execution_count is None, f"cell {i} keeps an output of the solved source"
        assert CHECK_OUTPUT not in cell.source, f"cell {i}"
    assert "correct" not in (ROOT / "labs" / source.name).read_text().split('quiz.score(')[-1]


def test_an_exam_release_writes_keyless_banks_beside_the_learner_copies(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lablib", "release", "--quiz", "exam", "sources",
                          str(tmp_path / "labs")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"keyless exam banks -> {tmp_path / 'quizzes'}" in out.stdout
    for path in (ROOT / "quizzes").glob("*.yaml"):
        text = (tmp_path / "quizzes" / path.name).read_text(encoding="utf-8")
        assert "\nmode: exam\n" in text
        assert not any(f"  {key}:" in text for key in ("answer", "key", "tolerance", "explanation", "hint")), path.name
    for path in SOURCES:  # the notebooks are the practice ones
        assert (tmp_path / "labs" / path.name).read_text() == (ROOT / "labs" / path.name).read_text()
    check = subprocess.run([sys.executable, "-m", "lablib", "quiz", "check", str(tmp_path / "quizzes")],
                           cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0 and "exam copy, no answer key" in check.stdout, check.stderr
    again = subprocess.run([sys.executable, "-m", "lablib", "release", "--check", "--quiz", "exam", "sources",
                            str(tmp_path / "labs")], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr


def test_an_exam_release_never_overwrites_the_keyed_banks():
    before = {p.name: p.read_text() for p in (ROOT / "quizzes").glob("*.yaml")}
    out = subprocess.run([sys.executable, "-m", "lablib", "release", "--quiz", "exam", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 1 and "would overwrite their answer keys" in out.stderr and "--banks-out" in out.stderr
    assert {p.name: p.read_text() for p in (ROOT / "quizzes").glob("*.yaml")} == before


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_sources_keep_outputs_only_where_nbval_compares_them(source):
    nb = nbformat.read(source, as_version=4)
    assert "widgets" not in nb.metadata, "saved widget state (quiz answers included): run `lablib tidy`"
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        if CHECK_OUTPUT in cell.source:
            assert cell.outputs and cell.execution_count, f"cell {i}: run it and keep its output (lablib tidy)"
        else:
            assert not cell.outputs, f"cell {i} stores outputs nbval never compares: run `lablib tidy {source}`"


@pytest.fixture(scope="module")
def untouched():
    """Every learner copy run as nbval runs it (learner_copies.py): {(notebook, cell): (status, failure text)}."""
    return learner_copies.results()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_untouched_learner_copy_fails_its_checks_and_only_them(source, untouched):
    learner = ROOT / "labs" / source.name
    results = {cell: r for (name, cell), r in untouched.items() if name == source.name}
    nb = nbformat.read(learner, as_version=4)
    assert "widgets" not in nb.metadata and "Your saved answer" not in learner.read_text()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(results) == len(code)
    for n, cell in enumerate(code):
        status, detail = results[n]
        if grade_info(cell):
            assert status == "failed", f"check cell {n} passed on an untouched copy"
            assert "is not done yet" in detail and "NotImplementedError" in detail, detail
        elif "quiz.score(" in cell.source:
            assert status == "passed"  # no expected score to compare with: the learner copy has none
        else:
            assert status == "passed", f"cell {n} failed on an untouched copy:\n{detail}"


def test_run_all_on_an_untouched_copy_runs_the_whole_lab_and_names_the_open_task(tmp_path, monkeypatch):
    """In a learner's notebook (not strict) a task not done yet prints one line and Run All goes on."""
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "labs" / "00_welcome.ipynb", as_version=4)
    monkeypatch.setenv("LABLIB_STRICT", "0")  # the kernel inherits this process's environment
    monkeypatch.setenv("LABLIB_ANSWERS", str(tmp_path / "answers.json"))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "labs")}}).execute()
    check = next(c for c in nb.cells if (grade_info(c) or {}).get("grade_id") == "check-0.1")
    text = "".join(o.get("text", "") for o in check.outputs)
    assert "✗ Task 0.1 is not done yet" in text and "The rest of the lab still runs" in text
    assert "quiz.score(" in nb.cells[-1].source and nb.cells[-1].outputs  # the last cell ran
