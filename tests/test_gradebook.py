"""What `lablib grade` writes besides grading: escaped text, LMS gradebook imports, JUnit XML, shards
joined into one gradebook, the box's folder removed however deep; and exercise code on the ranks
keeping the builtins it has in the box. (Grading itself: tests/test_grading.py.)"""
import csv
import os
import xml.etree.ElementTree as ET

import pytest

from lablib.course.gradebook import (COLUMNS, GradebookError, Item, LabResult, clean, fenced, merge, read_roster,
                                     read_rows, rows, write_junit, write_lms, write_report, write_rows)


def _results():
    a = LabResult("ada", "00_welcome", [Item("ada", "00_welcome", "check-0.1", "check", 1, 1, "passed"),
                                         Item("ada", "00_welcome", "welcome/rank", "quiz", 0, 1, "wrong")])
    b = LabResult("ada", "01_sharding", [Item("ada", "01_sharding", "check-1.1", "check", 0, 2, "failed",
                                              "Task 1.1: \ud800 ``` \x1b[31m")])
    c = LabResult("bob", "00_welcome", [Item("bob", "00_welcome", "check-0.1", "check", 0, 1, "refused", "why")],
                  notes=["invalid: cell 2 is too large to grade"])
    d = LabResult("bob", "01_sharding", [Item("bob", "01_sharding", "check-1.1", "check", 2, 2, "passed")])
    return [a, b, c, d]


def test_learners_text_is_escaped_and_a_code_block_outlasts_its_backticks():
    assert clean("a\ud800b\x1b[0m\u202ec\n\td ✓ é") == "a\\ud800b\\u001b[0m\\u202ec\n\td ✓ é"
    assert fenced("x ``` y\n````") == ["`````", "x ``` y", "````", "`````"]
    assert fenced("plain", "  ") == ["  ```", "  plain", "  ```"]


def test_a_report_with_a_lone_surrogate_is_written_as_utf8(tmp_path):
    write_report(_results()[:2], tmp_path, secret="0123456789ab")
    text = (tmp_path / "ada.md").read_bytes().decode("utf-8")
    assert "  Task 1.1: \\ud800 ``` \\u001b[31m" in text.splitlines()
    assert "  ````" in text.splitlines() and "fingerprint 0123456789ab" in text


def test_rows_round_trip_and_shards_merge_in_learner_order(tmp_path):
    table = rows(_results())
    assert [r["item"] for r in table] == ["check-0.1", "welcome/rank", "TOTAL", "check-1.1", "TOTAL", "check-0.1",
                                          "TOTAL", "check-1.1", "TOTAL"]
    assert table[5]["detail"] == "why" and table[0]["detail"] == ""  # why it failed; nothing for a pass
    assert table[6]["status"] == "invalid: cell 2 is too large to grade"
    write_rows(table, tmp_path / "gb.csv")
    assert read_rows(tmp_path / "gb.csv") == table
    ada, bob = table[:5], table[5:]
    assert merge({"shard2": bob, "shard1": ada}) == table
    with pytest.raises(GradebookError, match="learner bob is in both shard1 and shard2"):
        merge({"shard1": table, "shard2": bob})
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(GradebookError, match="not a gradebook lablib wrote"):
        read_rows(tmp_path / "other.csv")


def _roster(tmp_path, text):
    (tmp_path / "roster.csv").write_text(text)
    return tmp_path / "roster.csv"


def test_canvas_gets_its_gradebook_import_columns_and_points_possible(tmp_path):
    roster = read_roster(_roster(tmp_path, "learner,Student,ID,SIS User ID,SIS Login ID,Section\n"
                                           "ada,\"Lovelace, Ada\",101,s1,ada@uni,A\nbob,\"Babbage, Charles\",102,s2,bob@uni,A\n"),
                         "canvas")
    write_lms(rows(_results()), tmp_path / "canvas.csv", "canvas", roster)
    got = list(csv.reader(open(tmp_path / "canvas.csv", newline="")))
    # Canvas's importer: Student first, ID second, the identity columns end with Section; then assignments
    assert got[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "00_welcome", "01_sharding", "Total"]
    assert got[1] == ["    Points Possible", "", "", "", "", "2", "2", "4"]
    assert got[2] == ["Lovelace, Ada", "101", "s1", "ada@uni", "A", "1", "0", "1"]
    assert got[3] == ["Babbage, Charles", "102", "s2", "bob@uni", "A", "0", "2", "2"]


def test_moodle_gets_one_identifier_column_and_a_column_per_grade_item(tmp_path):
    roster = read_roster(_roster(tmp_path, "learner,Email address\nada,ada@uni\nbob,bob@uni\n"), "moodle")
    write_lms(rows(_results()), tmp_path / "moodle.csv", "moodle", roster)
    got = list(csv.reader(open(tmp_path / "moodle.csv", newline="")))
    assert got == [["Email address", "00_welcome", "01_sharding", "Total"], ["ada@uni", "1", "0", "1"],
                   ["bob@uni", "0", "2", "2"]]


@pytest.mark.parametrize("text, message", [
    ("name,Email address\nada,a@x\n", "needs a column 'learner'"),
    ("learner,Phone\nada,1\n", "at least one of moodle's identity columns"),
    ("learner,Email address\nada,\n", "line 2: a learner and an identity"),
    ("learner,Email address\nada,a@x\nada,b@x\n", "line 3: learner ada is listed twice"),
])
def test_a_roster_that_cannot_be_used_says_why(tmp_path, text, message):
    with pytest.raises(GradebookError, match=message):
        read_roster(_roster(tmp_path, text), "moodle")


def test_a_learner_missing_from_the_roster_is_an_error_not_a_lost_grade(tmp_path):
    roster = read_roster(_roster(tmp_path, "learner,Email address\nada,ada@uni\n"), "moodle")
    with pytest.raises(GradebookError, match="the roster has no row for bob"):
        write_lms(rows(_results()), tmp_path / "moodle.csv", "moodle", roster)
    assert not (tmp_path / "moodle.csv").exists()


def test_junit_xml_has_what_its_schema_requires(tmp_path):
    write_junit(rows(_results()), tmp_path / "results.xml")
    root = ET.parse(tmp_path / "results.xml").getroot()
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["ada", "bob"]
    for suite in suites:  # the JUnit schema's required attributes (Jenkins' junit-10.xsd, pytest's)
        for attr in ("name", "tests", "failures", "errors", "skipped", "time", "timestamp", "hostname"):
            assert suite.get(attr) is not None, attr
        cases = suite.findall("testcase")
        assert int(suite.get("tests")) == len(cases)
        assert int(suite.get("failures")) == sum(c.find("failure") is not None for c in cases)
        for case in cases:
            assert case.get("name") and case.get("classname") and case.get("time") is not None
    ada = {c.get("name"): c for c in suites[0].findall("testcase")}
    assert ada["check-0.1"].find("failure") is None and ada["check-0.1"].get("classname") == "lablib.ada.00_welcome"
    failure = ada["check-1.1"].find("failure")
    assert failure.get("message") == "failed: 0/2 points" and failure.text == "Task 1.1: \\ud800 ``` \\u001b[31m"
    assert ada["welcome/rank"].find("failure").get("type") == "quiz"


def test_a_box_folder_of_any_depth_and_modes_is_removed(tmp_path):
    from lablib.course.box import _remove

    folder = deep = tmp_path / "box"
    folder.mkdir()
    for _ in range(1100):  # deeper than rmtree's recursion (and os.makedirs')
        deep = deep / "d"
        deep.mkdir()
    (deep / "f").write_text("x")
    os.chmod(folder / "d", 0o500)
    assert _remove(folder) == ""
    assert not folder.exists()


def _restricted_builtins(fns):
    # a function's own __builtins__ (fixed when it is made), not its globals' entry: the one its frames use
    return [sorted(fn.__builtins__) for fn in fns]


def _call(fn):
    return fn()


def test_exercise_functions_keep_the_boxs_builtins_on_the_ranks(monkeypatch):
    """cloudpickle rebuilds a function on the rank with the rank's real builtins; in a grading box
    (LABLIB_GRADING=1, which its ranks inherit) the exercise namespace's functions (and their helpers and
    classes) are rebuilt with the box's builtins instead, so a name the box lacks is not there on the ranks."""
    from lablib import Cluster, RankError
    from lablib.rules.namespace import exercise_builtins, namespace

    monkeypatch.setenv("LABLIB_GRADING", "1")

    ns = namespace()
    exec(compile("def helper(x):\n    return x\n"
                 "class Fn:\n    @staticmethod\n    def forward(x):\n        return helper(x)\n"
                 "def mine(x):\n    return Fn.forward(x)\n"
                 "def leak():\n    return open\n", "<exercise>", "exec"), ns)
    with Cluster(2, quiet=True) as cluster:
        got = cluster.run(_restricted_builtins, [ns["mine"], ns["helper"], ns["Fn"].forward])
        with pytest.raises(RankError, match="name 'open' is not defined"):
            cluster.run(_call, ns["leak"])
    assert got == [[sorted(exercise_builtins())] * 3] * 2
    assert "getattr" not in exercise_builtins() and "open" not in exercise_builtins()
