"""Release and grade, on a small course built here: every kind of submission an instructor meets."""
import csv
import json
import os
import re
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from lablib import quiz
from lablib.course.grade import restore_graded_cells
from lablib.course.notebook import grade_info
from lablib.course.release import ReleaseError, release, release_notebook

LAB = "00_welcome"  # the fixture borrows this lab's name, so its quiz questions are real ones
SOLUTION = "    t = torch.tensor([float(x)])\n    lablib.all_reduce(t)\n    return 2 * t.item()"


# Long enough for the first cell to start a 2-rank pool on a very busy machine (it took over 8 s with
# three test runs and two CPU burners on 2 cores), short enough that the hanging learner stays cheap.
CELL_TIMEOUT = 30


def _graded(src, gid, points):
    cell = new_code_cell(src)
    cell.metadata["lablib"] = {"grade_id": gid, "points": points}
    return cell


def _source():
    key = new_code_cell(f'quiz.solve("{LAB}")')
    key.metadata["tags"] = ["source-only"]
    score = new_code_cell(f'# NBVAL_CHECK_OUTPUT\nquiz.score("{LAB}")', execution_count=1,
                          outputs=[new_output("stream", name="stdout", text=f"{LAB}: 6/6 correct\n")])
    return new_notebook(cells=[
        new_markdown_cell("# A small lab"),
        new_code_cell("import torch, lablib\nfrom lablib import quiz\ncluster = lablib.cluster(2, timeout=5)"),
        new_code_cell(f"def double(x):\n    ### BEGIN SOLUTION Task 9.1: twice x, summed over ranks\n{SOLUTION}\n"
                      "    ### END SOLUTION"),
        _graded("vals = cluster.run(double, 3)\nassert vals == [12.0, 12.0], f'expected [12.0, 12.0], got {vals}'\n"
                "### BEGIN HIDDEN CHECKS\nassert cluster.run(double, 1) == [4.0, 4.0]\n### END HIDDEN CHECKS",
                "check-9.1", 2),
        new_code_cell('quiz.ask("welcome/rank")'),
        key, score], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


def _learner(release_nb, body=None, check=None, delete_check=False):
    nb = nbformat.from_dict(json.loads(json.dumps(release_nb)))
    if body is not None:
        nb.cells[2].source = f"def double(x):\n{body}"
    if check is not None:
        nb.cells[3].source = check
    if delete_check:
        del nb.cells[3]
    return nb


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    (root / "source").mkdir()
    nbformat.write(_source(), root / "source" / f"{LAB}.ipynb")
    release(root / "source", root / "release")
    released = nbformat.read(root / "release" / f"{LAB}.ipynb", as_version=4)
    subs = root / "submissions"
    learners = {
        "untouched": (_learner(released), None),
        "solved": (_learner(released, SOLUTION), "all"),
        "partial": (_learner(released, SOLUTION), "some"),
        "tampered": (_learner(released, check="pass"), None),
        "hangs": (_learner(released, "    while True:\n        pass"), None),
        "crashes": (_learner(released, "    import os\n    os._exit(1)"), None),
        "deleted": (_learner(released, delete_check=True), None),
    }
    for name, (nb, answers) in learners.items():
        (subs / name).mkdir(parents=True)
        nbformat.write(nb, subs / name / f"{LAB}.ipynb")
        store = quiz.AnswerStore(subs / name / "quiz_answers.json")
        if answers == "all":
            quiz.solve(LAB, store)
        elif answers == "some":
            for q in quiz.questions(LAB)[:3]:
                store.record(q.ref, q.answer if q.type == "numeric" else sorted(q.answer), True)
            store.record("welcome/backend", [0], False)
    (subs / "empty").mkdir()  # a learner who submitted nothing
    (subs / "garbled").mkdir()
    (subs / "garbled" / f"{LAB}.ipynb").write_text("{ not a notebook")
    out = root / "gradebook.csv"
    proc = subprocess.run([sys.executable, "-m", "lablib", "grade", str(subs), "--release", str(root / "release"),
                           "--source", str(root / "source"), "--out", str(out), "--cell-timeout", str(CELL_TIMEOUT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csv.DictReader(open(out)))
    return root, released, rows, proc.stdout


def _points(rows, learner, item):
    (row,) = [r for r in rows if r["learner"] == learner and r["item"] == item]
    return float(row["points"]), float(row["max_points"]), row["status"]


def test_release_stubs_solutions_and_removes_hidden_checks_and_source_only_cells(course):
    _, released, _, _ = course
    src = "\n".join(c.source for c in released.cells)
    assert "raise NotImplementedError('Task 9.1: twice x, summed over ranks')" in src
    assert "t.item()" not in src and "HIDDEN" not in src and "cluster.run(double, 1)" not in src
    assert "quiz.solve" not in src
    assert all(c.outputs == [] for c in released.cells if c.cell_type == "code" and "NBVAL" not in c.source)
    assert released.cells[-1].outputs[0]["text"] == f"{LAB}: 6/6 correct\n"
    assert grade_info(released.cells[3]) == {"grade_id": "check-9.1", "points": 2}


def test_untouched_release_scores_zero(course):
    root, _, rows, _ = course
    assert _points(rows, "untouched", "check-9.1") == (0, 2, "failed")
    assert _points(rows, "untouched", "TOTAL") == (0, 8, "")  # and is not reported as tampered
    report = (root / "gradebook-reports" / "untouched.md").read_text()
    assert "```\n  NotImplementedError: Task 9.1: twice x, summed over ranks\n  ```" in report
    assert "Tampered" not in report and "\x1b" not in report and "#x1B" not in report
    assert {r["status"] for r in rows if r["learner"] == "untouched" and r["kind"] == "quiz"} == {"unanswered"}


def test_fully_solved_gets_full_marks_with_hidden_checks(course):
    _, _, rows, _ = course
    assert _points(rows, "solved", "check-9.1") == (2, 2, "passed")
    assert _points(rows, "solved", "TOTAL") == (8, 8, "")


def test_partial_credit(course):
    _, _, rows, _ = course
    assert _points(rows, "partial", "check-9.1")[0] == 2
    assert _points(rows, "partial", "welcome/backend") == (0, 1, "wrong")
    assert _points(rows, "partial", "TOTAL")[:2] == (2 + 3, 8)


def test_an_edited_check_is_restored_and_reported(course):
    root, _, rows, stdout = course
    assert _points(rows, "tampered", "check-9.1") == (0, 2, "failed")
    assert _points(rows, "tampered", "TOTAL")[2] == "tampered: 1"
    report = (root / "gradebook-reports" / "tampered.md").read_text()
    assert "Tampered check cell check-9.1: edited; restored from the release." in report
    assert "Task 9.1" in report  # the failure says why: the exercise is not done
    assert "(tampered: check-9.1)" in stdout


def test_an_unreadable_notebook_is_graded_zero_with_the_reason(course):
    root, _, _, _ = course
    assert "notebook could not be read" in (root / "gradebook-reports" / "garbled.md").read_text()


def test_a_deleted_check_is_put_back(course):
    _, _, rows, _ = course
    assert _points(rows, "deleted", "check-9.1") == (0, 2, "failed")
    assert _points(rows, "deleted", "TOTAL")[2] == "tampered: 1"


def test_a_hanging_exercise_times_out_and_grading_goes_on(course):
    root, _, rows, _ = course
    assert _points(rows, "hangs", "check-9.1") == (0, 2, "timed out")
    report = (root / "gradebook-reports" / "hangs.md").read_text()
    assert f"Timeout of {CELL_TIMEOUT} seconds exceeded" in report


def test_crashing_rank_code_is_graded_zero_with_the_reason(course):
    root, _, rows, _ = course
    assert _points(rows, "crashes", "check-9.1") == (0, 2, "failed")
    report = (root / "gradebook-reports" / "crashes.md").read_text()
    assert re.search(r"```\n  RankError: rank (\d) of 2 failed: rank \1 died \(exit code 1\)", report), report


def test_every_learner_is_graded_in_one_run_and_nothing_is_left_running(course):
    _, _, rows, _ = course
    learners = {r["learner"] for r in rows}
    assert learners == {"untouched", "solved", "partial", "tampered", "hangs", "crashes", "deleted", "empty", "garbled"}
    assert _points(rows, "empty", "check-9.1")[2] == "missing notebook"
    assert _points(rows, "garbled", "check-9.1")[2] == "missing notebook"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        assert b"LABLIB_GRADE_TAG=" not in environ, f"process {pid} outlived its grading"


def test_restore_puts_a_deleted_check_after_its_exercise():
    released = release_notebook(_source(), "fixture.ipynb")
    learner = _learner(released, delete_check=True)
    learner.cells.insert(1, new_code_cell("print('my own cell')"))
    restored, reports = restore_graded_cells(learner, released)
    assert reports == ["check-9.1: deleted; restored from the release"]
    ids = [grade_info(c)["grade_id"] if grade_info(c) else c.source[:12] for c in restored.cells]
    assert ids.index("check-9.1") == ids.index("def double(x") + 1


@pytest.mark.parametrize("edit, message", [
    (lambda nb: setattr(nb.cells[2], "source", nb.cells[2].source.replace(" Task 9.1: twice x, summed over ranks", "")),
     r"cell 2, line 2: name the task after BEGIN SOLUTION"),
    (lambda nb: setattr(nb.cells[2], "source", nb.cells[2].source.replace("### END SOLUTION", "")),
     r"cell 2, line 2: BEGIN SOLUTION without END SOLUTION"),
    (lambda nb: nb.cells[3].metadata.pop("lablib"), r"the exercise in cell 2 must be followed by a graded check cell"),
    (lambda nb: nb.cells.pop(), r"the last code cell must be the quiz score cell"),
    (lambda nb: nb.cells[4].metadata.update(lablib={"grade_id": "check-9.1", "points": 1}),
     r"grade_id 'check-9.1' is also used by cell 3"),
])
def test_release_rejects_bad_sources(edit, message):
    nb = _source()
    edit(nb)
    with pytest.raises(ReleaseError, match=message):
        release_notebook(nb, "fixture.ipynb")


def test_grade_fails_only_when_it_cannot_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lablib", "grade", str(tmp_path / "nope"), "--release", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and re.search(r"no released notebooks", proc.stderr)
