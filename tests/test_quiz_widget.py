"""The quiz widgets driven from Python, the score line and the assert-style check."""
import re

import pytest

from lablib import quiz
from lablib.quiz.store import AnswerStore
from lablib.quiz.widget import QuestionView, QuizView


@pytest.fixture
def store(tmp_path):
    return AnswerStore(tmp_path / "quiz_answers.json")


def _q(ref):
    (q,) = quiz.questions(ref)
    return q


def test_single_choice_feedback_attempts_and_retry(store):
    v = QuestionView(_q("fsdp/2"), store)
    assert v.feedback.value == "" and v.attempts.value == ""
    v.check()
    assert "Pick an answer first." in v.feedback.value and store.load() == {}
    v.control.value = 0  # "Broadcast only"
    v.check_button.click()
    assert "✗ Not quite." in v.feedback.value and "All-gather sends every shard" in v.feedback.value
    assert v.attempts.value == "attempts: 1"
    v.control.value = 1  # "All-gather"
    v.check_button.click()
    assert "✓ Correct." in v.feedback.value and v.attempts.value == "attempts: 2"
    assert v.correct


def test_a_rebuilt_widget_shows_the_saved_answer_and_feedback(store):
    v = QuestionView(_q("fsdp/2"), store)
    v.control.value = 1
    v.check()
    again = QuestionView(_q("fsdp/2"), AnswerStore(store.path))
    assert again.control.value == 1
    assert "✓ Correct." in again.feedback.value and "Your saved answer." in again.feedback.value
    assert again.attempts.value == "attempts: 1"
    again.set_language("ms")  # still marked as the saved answer, in the new language
    assert "Jawapan anda yang disimpan." in again.feedback.value
    assert "Your saved answer." in quiz.ask("fsdp/2", store=AnswerStore(store.path)).feedback.value
    again.check()
    assert "disimpan" not in again.feedback.value  # an answer just given is not "saved" news


def test_numeric_question_parses_numbers_and_applies_the_tolerance(store):
    v = QuestionView(_q("welcome/waiting"), store)
    v.control.value = "twenty"
    v.check()
    assert "Enter a number" in v.feedback.value and store.load() == {}
    v.control.value = "24.5"
    v.check()
    assert "✓ Correct." in v.feedback.value
    v.control.value = "27"
    v.check()
    assert "✗ Not quite." in v.feedback.value and v.attempts.value == "attempts: 2"
    assert QuestionView(_q("welcome/waiting"), store).control.value == "27"


def test_multiple_choice_needs_exactly_the_right_set(store):
    v = QuestionView(_q("welcome/collectives"), store)
    assert "Select all that apply." in v.hint.value
    v.boxes[0].value = v.boxes[1].value = True
    v.check()
    assert "✗" in v.feedback.value
    v.boxes[3].value = True
    v.check()
    assert "✓" in v.feedback.value
    rebuilt = QuestionView(_q("welcome/collectives"), store)
    assert [b.value for b in rebuilt.boxes] == [True, True, False, True]


def test_language_switch_keeps_the_answer_and_translates_everything(store):
    v = QuestionView(_q("fsdp/2"), store, "en")
    v.control.value = 1
    v.check()
    v.set_language("ms")
    assert "Operasi kolektif manakah" in v.text.value
    assert v.control.options[1] == ("b) Semua berkumpul", 1) and v.control.value == 1
    assert "Betul." in v.feedback.value and v.check_button.description == "Semak"
    assert v.attempts.value == "cubaan: 1"


def test_whole_quiz_navigation_preview_score_and_rtl(store):
    view = QuizView(quiz.banks()["model-pipeline"], store, lang="en")
    assert "Question 1 of 8" in view.position.value and view.prev.disabled
    assert "level: hard" in view.header.value and "Model and pipeline parallelism quiz" in view.header.value
    assert "Answers and explanations appear as you take the quiz." in view.header.value
    assert "04_tensor_parallel.ipynb" in view.header.value
    assert view.preview.get_title(0) == "Preview every question (8 questions)"
    assert len(view.preview_buttons) == 8
    view.views[0].control.value = 0
    view.views[0].check()
    assert "Score: 1/8 correct" in view.score_label.value
    assert view.preview_buttons[0].description.startswith("✓ 1.")
    view.next.click()
    assert "Question 2 of 8" in view.position.value and view.slot.children == (view.views[1].widget,)
    view.preview_buttons[7].click()
    assert "Question 8 of 8" in view.position.value and view.next.disabled
    view.picker.value = "ar"
    assert "سؤال 8 من 8" in view.position.value
    assert "lablib-rtl" in view.widget._dom_classes
    assert "صعب المستوى" in view.header.value
    assert "النتيجة: 1/8 صحيحة" in view.score_label.value
    view.picker.value = "en"
    assert "lablib-rtl" not in view.widget._dom_classes


def test_language_defaults_from_the_environment(store, monkeypatch):
    monkeypatch.setenv("LABLIB_LANG", "ms")
    assert QuizView(quiz.banks()["fsdp"], store).lang == "ms"
    assert QuizView(quiz.banks()["model-pipeline"], store).lang == "en"  # no Malay there: English
    monkeypatch.setenv("LABLIB_LANG", "xx")
    with pytest.raises(ValueError, match="unknown language 'xx'"):
        QuizView(quiz.banks()["fsdp"], store)


def test_score_prints_one_stable_line_and_check_names_what_is_missing(store, capsys):
    quiz.score("welcome", store)
    assert capsys.readouterr().out == "welcome: 0/6 correct\n"
    for q in quiz.questions("welcome")[:4]:
        store.record(q.ref, sorted(q.answer) if q.type != "numeric" else q.answer, True)
    store.record("welcome/mismatch", [0], False)
    quiz.score("welcome", store)
    assert capsys.readouterr().out == "welcome: 4/6 correct\n"
    with pytest.raises(AssertionError) as info:
        quiz.check("welcome", store)
    msg = str(info.value)
    assert "not correct yet: welcome/mismatch" in msg and "unanswered: welcome/collectives" in msg
    store.record("welcome/mismatch", [1], True)
    store.record("welcome/collectives", [0, 1, 3], True)
    quiz.check("welcome", store)


def test_a_lab_name_gathers_seed_questions_placed_in_it(store, capsys):
    refs = [q.ref for q in quiz.questions("01_sharding")]
    assert {"fsdp/1", "fsdp/3", "fsdp/4", "fsdp/7", "fsdp/8"} <= set(refs)
    quiz.score("01_sharding", store)
    assert re.fullmatch(r"01_sharding: 0/\d+ correct\n", capsys.readouterr().out)


def test_the_stored_correct_flag_is_not_trusted(store, capsys):
    store.record("fsdp/2", [0], True)  # a hand-edited file claiming a wrong answer is right
    quiz.score("fsdp/2", store)
    assert capsys.readouterr().out == "fsdp/2: 0/1 correct\n"


def test_ask_returns_a_displayable_view_and_rejects_a_whole_quiz(store):
    v = quiz.ask("model-pipeline/3", lang="ar", store=store)
    assert "lablib-rtl" in v.outer._dom_classes
    v.picker.value = "en"  # a seed question embedded in a lab keeps its language switch
    assert "lablib-rtl" not in v.outer._dom_classes and "bubble" in v.text.value
    assert quiz.ask("welcome/rank", store=store).picker is None  # English only: no switch
    assert "application/vnd.jupyter.widget-view+json" in v._repr_mimebundle_()
    with pytest.raises(ValueError, match="use show"):
        quiz.ask("fsdp", store=store)
    with pytest.raises(KeyError, match="has no question '9'"):
        quiz.ask("fsdp/9", store=store)
