"""Quiz points for the gradebook: first attempts, revealed answers, answers given elsewhere, and an
answers file that may hold anything at all."""
import json
from pathlib import Path

import pytest

from lablib.quiz import QuizError, load_all
from lablib.quiz.grading import QuizItem, feedback, grade_lab

ROOT = Path(__file__).resolve().parents[1]
LAB = "00_welcome"  # welcome/rank (single, a), all-reduce-sum (numeric, 10), waiting, backend, mismatch, collectives


@pytest.fixture(scope="module")
def banks():
    return load_all(ROOT / "quizzes")


def _items(answers, banks, lab=LAB, **kw) -> dict[str, QuizItem]:
    return {item.ref: item for item in grade_lab(lab, answers, banks, **kw)}


def _rec(response, attempts=1, first=None, **extra):
    rec = {"response": response, "attempts": attempts, "where": LAB, **extra}
    rec["first_response"] = response if first is None else first
    return rec


def test_a_point_for_a_right_first_attempt_only(banks):
    items = _items({
        "welcome/rank": _rec([0]),
        "welcome/all-reduce-sum": _rec(10, attempts=3, first=4),
        "welcome/waiting": _rec(27, attempts=2, first=25),   # right first, changed later: the point stays
        "welcome/backend": _rec([1], revealed=True),
        "welcome/mismatch": _rec([0]),
        "welcome/collectives": _rec([0, 1, 3], attempts=2, first_correct=False),  # the record says no: no point
    }, banks)
    assert [(i.status, i.points, i.max_points, i.attempts) for i in items.values()] == [
        ("correct", 1.0, 1.0, 1), ("correct after 3 attempts", 0.0, 1.0, 3), ("correct", 1.0, 1.0, 2),
        ("answer revealed", 0.0, 1.0, 1), ("wrong", 0.0, 1.0, 1), ("correct after 2 attempts", 0.0, 1.0, 2)]
    assert list(items) == ["welcome/rank", "welcome/all-reduce-sum", "welcome/waiting", "welcome/backend",
                           "welcome/mismatch", "welcome/collectives"]


def test_old_records_count_only_with_a_single_attempt(banks):
    old = lambda response, attempts: {"response": response, "correct": True, "attempts": attempts}  # noqa: E731
    items = _items({"welcome/rank": old([0], 1), "welcome/backend": old([1], 2),
                    "welcome/mismatch": {"response": [1], "correct": True}}, banks)
    assert items["welcome/rank"].status == "correct" and items["welcome/rank"].points == 1
    assert (items["welcome/backend"].status, items["welcome/backend"].points) == ("correct after 2 attempts", 0)
    assert (items["welcome/mismatch"].status, items["welcome/mismatch"].points) == ("invalid answer", 0)


def test_exam_records_are_graded_on_the_latest_answer(banks):
    items = _items({"welcome/rank": {"response": [0], "attempts": 5, "mode": "exam", "where": LAB},
                    "welcome/backend": {"response": [0], "attempts": 1, "mode": "exam", "where": LAB}}, banks)
    assert (items["welcome/rank"].status, items["welcome/rank"].points) == ("correct", 1)
    assert items["welcome/backend"].status == "wrong"
    forced = _items({"welcome/rank": {"response": [0], "attempts": 5, "mode": "exam", "where": LAB}}, banks,
                    mode="practice")
    assert forced["welcome/rank"].status == "correct after 5 attempts"


def test_only_answers_given_in_the_lab_count(banks):
    answers = {"fsdp/1@quiz:fsdp": {"response": [0], "attempts": 1, "first_response": [0], "where": "quiz:fsdp"},
               "fsdp/3": {"response": [2], "attempts": 1, "first_response": [2], "where": "quiz:fsdp"},
               "fsdp/4": {"response": [3], "attempts": 1, "first_response": [3], "where": "01_sharding"}}
    items = _items(answers, banks, lab="01_sharding")
    assert (items["fsdp/1"].status, items["fsdp/1"].points) == ("unanswered", 0)
    assert "answered only in the whole-quiz view of 'fsdp', which does not count for a lab" in items["fsdp/1"].detail
    assert items["fsdp/3"].status == "unanswered" and "does not count here" in items["fsdp/3"].detail
    assert (items["fsdp/4"].status, items["fsdp/4"].points) == ("correct", 1)
    assert "fsdp/2" not in items  # placed in 02_collectives
    assert grade_lab("no_such_lab", answers, banks) == []


JUNK = {
    "a string record": "yes",
    "a list record": [[0], 1],
    "a number record": 7,
    "no response": {"attempts": 1, "where": LAB},
    "a null response": {"response": None, "attempts": 1, "where": LAB},
    "a string response": {"response": "a", "attempts": 1, "where": LAB},
    "a nested response": {"response": [[0]], "attempts": 1, "where": LAB},
    "a dict response": {"response": {"0": 1}, "attempts": 1, "where": LAB},
    "a huge list": {"response": list(range(10**6)), "attempts": 1, "where": LAB},
    "a repeated choice": {"response": [0, 0], "attempts": 1, "where": LAB},
    "a choice out of range": {"response": [9], "attempts": 1, "where": LAB},
    "a negative choice": {"response": [-4], "attempts": 1, "where": LAB},
    "a boolean choice": {"response": [True], "attempts": 1, "where": LAB},
    "a float choice": {"response": [0.0], "attempts": 1, "where": LAB},
    "two choices for a single-choice question": {"response": [0, 1], "attempts": 1, "where": LAB},
    "junk attempts": {"response": [0], "attempts": "one", "where": LAB},
    "negative attempts": {"response": [0], "attempts": -1, "where": LAB},
    "boolean attempts": {"response": [0], "attempts": True, "where": LAB},
    "a junk place": {"response": [0], "attempts": 1, "where": [LAB]},
    "a first answer unlike the only one": {"response": [0], "attempts": 1, "first_response": [1], "where": LAB},
}


@pytest.mark.parametrize("what", JUNK)
def test_junk_records_are_worth_nothing_and_never_raise(banks, what):
    item = _items({"welcome/rank": JUNK[what]}, banks)["welcome/rank"]
    assert item.points == 0 and item.max_points == 1
    assert item.status in ("invalid answer", "unanswered"), item.status
    assert isinstance(item.attempts, int)
    assert "welcome/rank" in feedback(LAB, {"welcome/rank": JUNK[what]}, banks)


@pytest.mark.parametrize("text", ["1e400", "-1e400", "NaN", "Infinity", "1" + "0" * 400, "true", '"10"', "[10]",
                                  "null", '{"x": 10}'])
def test_junk_numeric_responses_from_the_file_are_invalid(banks, text):
    raw = '{"welcome/all-reduce-sum": {"response": %s, "attempts": 1, "first_response": %s, "where": "%s"}}' % (
        text, text, LAB)
    answers = json.loads(raw)  # as AnswerStore.load reads it: 1e400 is inf, 10**400 a huge int
    item = _items(answers, banks)["welcome/all-reduce-sum"]
    assert (item.status, item.points) == ("invalid answer", 0)
    assert "(not a valid answer)" in feedback(LAB, answers, banks)


@pytest.mark.parametrize("answers", [None, [], "answers", 3, {"welcome/rank": {"response": [0], "attempts": 1,
                                                                                  "first_response": "x"}}])
def test_an_answers_mapping_that_is_not_one_scores_zero(banks, answers):
    items = grade_lab(LAB, answers, banks)
    assert len(items) == 6 and sum(i.points for i in items) == 0


def test_feedback_shows_each_answer_the_right_one_and_why(banks):
    answers = {"welcome/rank": _rec([1], attempts=2, first=[2]), "welcome/waiting": _rec(25),
               "welcome/collectives": _rec([0, 1, 3], revealed=True)}
    text = feedback(LAB, answers, banks)
    block = text.split("**welcome/rank**")[1].split("**welcome/")[0]
    assert "(0/1, wrong): In `torch.distributed`, what is a rank?" in block
    # letters as the learner saw them (welcome/rank shows the bank's c, a, b as b), c), d))
    assert "- Your answer: d) One CUDA core inside a GPU (first answer: b) One layer of the model)" in block
    assert "- Right answer: c) One process of the distributed job, usually driving one GPU" in block
    assert "- Why: A job of N ranks is N cooperating processes" in block
    assert "**welcome/waiting** (1/1, correct)" in text and "- Your answer: 25 ms" in text
    assert "- Right answer: 25 ± 1 ms" in text
    assert "**welcome/collectives** (0/1, answer revealed)" in text
    assert ("- Right answer: b) `dist.reduce_scatter_tensor`; c) `dist.all_reduce`; d) `dist.all_gather_into_tensor`"
            in text)  # in the order shown, not the bank's a, b, d
    assert "**welcome/mismatch** (0/1, unanswered)" in text and "- Your answer: (no answer)" in text
    assert text.count("- Why: ") == 6 and feedback("no_such_lab", answers, banks) == ""


def test_grading_needs_the_keyed_banks(banks, tmp_path):
    from lablib.course.release import keyless_bank

    (tmp_path / "welcome.yaml").write_text(keyless_bank(ROOT / "quizzes" / "welcome.yaml"), encoding="utf-8")
    with pytest.raises(QuizError, match="grade with the instructor's keyed banks"):
        grade_lab(LAB, {}, load_all(tmp_path))
