"""The quiz widgets driven from Python, the score line and the assert-style check."""
import re
from pathlib import Path

import pytest

from lablib import quiz
from lablib.quiz.bank import LETTERS
from lablib.quiz.grading import judge
from lablib.quiz.i18n import plain
from lablib.quiz.store import AnswerStore
from lablib.quiz.widget import QuestionView, QuizView, parse_number

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    return AnswerStore(tmp_path / "quiz_answers.json")


def _q(ref):
    (q,) = quiz.questions(ref)
    return q


def test_a_wrong_answer_gets_a_hint_and_a_right_one_the_explanation(store):
    q = _q("fsdp/2")
    v = QuestionView(q, store)
    assert v.feedback.value == "" and v.attempts.value == ""
    v.check()
    assert "Pick an answer first." in v.feedback.value and store.load() == {}
    v.control.value = 0  # "Broadcast only"
    v.check_button.click()
    assert "✗ Not quite." in v.feedback.value and "Hint:" in v.feedback.value
    assert "which collective ends with every rank holding everyone" in v.feedback.value.lower()
    assert "All-gather sends every shard" not in v.feedback.value  # the explanation waits for a right answer
    assert "All-gather" not in v.feedback.value and v.attempts.value == "attempts: 1"
    assert v.show_button.layout.display != "none"
    v.control.value = 1  # "All-gather"
    v.check_button.click()
    assert "✓ Correct." in v.feedback.value and "All-gather sends every shard" in v.feedback.value
    assert "Hint:" not in v.feedback.value and v.attempts.value == "attempts: 2"
    assert "No point for this one: the first attempt was not right." in v.feedback.value
    assert v.show_button.layout.display == "none" and v.correct


def test_right_at_the_first_attempt_scores_and_later_answers_change_nothing(store, capsys):
    v = QuestionView(_q("fsdp/2"), store)
    v.control.value = 1
    v.check()
    assert "✓ Correct." in v.feedback.value and "No point" not in v.feedback.value
    quiz.score("fsdp/2", store)
    assert capsys.readouterr().out == "fsdp/2: 1/1 correct at the first attempt\n"
    v.control.value = 0
    v.check()  # a wrong answer afterwards: the point was earned at the first attempt
    quiz.score("fsdp/2", store)
    assert capsys.readouterr().out == "fsdp/2: 1/1 correct at the first attempt\n"
    rec = store.load()["fsdp/2"]
    assert rec["first_response"] == [1] and rec["first_correct"] and rec["attempts"] == 2
    assert rec["where"] == "02_collectives"


def test_show_answer_reveals_answer_and_explanation_and_forfeits_the_point(store, capsys):
    v = QuestionView(_q("fsdp/2"), store)
    assert v.show_button.description == "Show answer" and "no point" in v.show_button.tooltip
    v.show_button.click()  # before any answer
    assert "Answer: d) All-gather" in v.feedback.value  # the letter it is shown with (the bank's b) and "All-gather sends every shard" in v.feedback.value
    assert "You asked for the answer, so this question scores no point." in v.feedback.value
    assert v.show_button.layout.display == "none"
    v.control.value = 1
    v.check()
    quiz.score("fsdp/2", store)
    assert capsys.readouterr().out == "fsdp/2: 0/1 correct at the first attempt\n"
    assert store.load()["fsdp/2"]["revealed"] is True
    again = QuestionView(_q("fsdp/2"), AnswerStore(store.path))
    assert "Answer: d) All-gather" in again.feedback.value and "Your saved answer." in again.feedback.value
    w = QuestionView(_q("fsdp/6"), store)
    w.control.value = 0
    w.check()
    w.show_button.click()  # after a wrong answer
    assert "Answer: a) Reduce-scatter" in w.feedback.value and "Hint:" not in w.feedback.value


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
    for text in ("twenty", "1e400", "nan"):
        v.control.value = text
        v.check()
        assert "Enter a number" in v.feedback.value and store.load() == {}
    v.control.value = "24.5"
    v.check()
    assert "✓ Correct." in v.feedback.value
    v.control.value = "27"
    v.check()
    assert "✗ Not quite." in v.feedback.value and v.attempts.value == "attempts: 2"
    assert "Hint:" in v.feedback.value and "25" not in v.feedback.value
    assert QuestionView(_q("welcome/waiting"), store).control.value == "27"


def test_multiple_choice_needs_exactly_the_right_set(store):
    v = QuestionView(_q("welcome/collectives"), store)
    assert "Select all that apply." in v.note.value
    v.boxes[0].value = v.boxes[1].value = True
    v.check()
    assert "✗" in v.feedback.value
    v.boxes[3].value = True
    v.check()
    assert "✓" in v.feedback.value
    rebuilt = QuestionView(_q("welcome/collectives"), store)
    assert [b.value for b in rebuilt.boxes] == [True, True, False, True]


def _choice_questions():
    return [q for b in quiz.banks().values() for q in b.questions if q.type != "numeric"]


def _labels(v) -> list[str]:
    """The choices as the learner sees them, top to bottom."""
    if v.q.type == "single":
        return [label for label, _ in v.control.options]
    return [box.description for box in v.control.children]


def test_choices_are_shown_in_an_order_of_their_own_the_same_on_every_build(tmp_path):
    # Pinned: a change of this order would show learners other letters than their reports name.
    assert [_q(ref).order for ref in ("fsdp/2", "welcome/rank", "welcome/collectives")] == [
        (0, 2, 3, 1), (3, 2, 0, 1), (2, 3, 0, 1)]
    moved = 0
    for q in _choice_questions():
        first = QuestionView(q, AnswerStore(tmp_path / "a.json"))
        second = QuestionView(q, AnswerStore(tmp_path / "b.json"))  # another build, another file
        assert _labels(first) == _labels(second), q.ref
        assert sorted(q.order) == list(range(len(q.choices)))
        assert [label[:3] for label in _labels(first)] == [f"{c}) " for c in LETTERS[:len(q.choices)]], q.ref
        for lang in quiz.banks()[q.quiz].languages:  # one order in every language
            first.set_language(lang)
            assert [label.split(") ", 1)[1] for label in _labels(first)] == [
                plain(q.choices[i][lang]) for i in q.order], (q.ref, lang)
        moved += q.order != tuple(range(len(q.choices)))
    assert moved > len(_choice_questions()) / 2
    shown = {_q(ref).shown(_q(ref).answer, "en")[0] for ref in
             ("fsdp/5", "prefetch/reshard-after-forward", "prefetch/gloo-overlap")}
    assert len(shown) > 1  # lab 03's keys no longer sit at one letter


def test_the_key_follows_its_choice_and_what_is_saved_is_the_bank_index(store, capsys):
    for q in _choice_questions():
        v = QuestionView(q, store)
        labels = _labels(v)
        right = [k for k, i in enumerate(q.order) if i in q.answer]  # where the right choices are shown
        assert [labels[k] for k in right] == [f"{LETTERS[k]}) {plain(q.choices[q.order[k]]['en'])}" for k in right]
        if q.type == "single":
            v.control.index = right[0]  # what a click on the shown choice does
        else:
            for k in right:
                v.control.children[k].value = True
        rec = v.check()
        assert rec["response"] == sorted(q.answer) and "✓ Correct." in v.feedback.value, q.ref
        assert judge(q, rec)[0] == "correct" and plain(q.answer_text("en")) == "; ".join(labels[k] for k in right)
    quiz.score("02_collectives", store)  # its 4 choice questions right, its 4 numeric ones left
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "02_collectives: 4/8 correct at the first attempt"
    assert all(_q(line.split(": ")[1]).type == "numeric" for line in out[1:]) and len(out) == 5
    (q,) = quiz.questions("fsdp/2")
    v = QuestionView(q, AnswerStore(store.path.with_name("other.json")))
    v.control.index = 1  # the second choice shown, the bank's c
    assert v.control.label == "b) Scatter" and v.check()["response"] == [2] and "✗ Not quite." in v.feedback.value
    v.show_button.click()
    assert "Answer: d) All-gather" in v.feedback.value and v.control.options[3] == ("d) All-gather", 1)


def test_answers_saved_before_the_shuffle_come_back_on_the_choice_they_named(store):
    # Files written before choices were shuffled hold bank indices, as files do now.
    store.put("fsdp/2", {"response": [1], "first_response": [1], "first_correct": True, "correct": True,
                         "attempts": 1, "where": "02_collectives"})
    store.put("welcome/collectives", {"response": [0, 1, 3], "first_response": [0, 1, 3], "first_correct": True,
                                      "correct": True, "attempts": 1, "where": "00_welcome"})
    v = QuestionView(_q("fsdp/2"), store)
    assert v.control.value == 1 and v.control.label == "d) All-gather" and v.control.index == 3
    assert "✓ Correct." in v.feedback.value and "Your saved answer." in v.feedback.value
    m = QuestionView(_q("welcome/collectives"), store)
    assert [box.value for box in m.control.children] == [False, True, True, True]  # shown a) to d)
    assert m.boxes[2].description.startswith("a) ") and not m.boxes[2].value  # the bank's c, shown first
    assert "✓ Correct." in m.feedback.value


def test_an_exam_shows_the_same_order_as_practice(tmp_path, monkeypatch):
    from lablib.course.release import keyless_bank

    before = {q.ref: _labels(QuestionView(q, AnswerStore(tmp_path / "p.json"))) for q in _choice_questions()}
    folder = tmp_path / "exam-quizzes"
    folder.mkdir()
    for path in sorted((ROOT / "quizzes").glob("*.yaml")):
        (folder / path.name).write_text(keyless_bank(path), encoding="utf-8")
    monkeypatch.setenv("LABLIB_QUIZZES", str(folder))
    after = {q.ref: _labels(QuestionView(q, AnswerStore(tmp_path / "e.json"))) for q in _choice_questions()}
    assert after == before


@pytest.mark.parametrize("text, unit, value", [
    ("0.25", "", 0.25), (" -3 ", "", -3), ("1.5e9", "", 1.5e9), ("1,000,000", "", 1e6), ("1_000", "", 1000),
    ("1,234.5", "", 1234.5), ("3/19", "", 3 / 19), ("3 / 19", "", 3 / 19), ("-1/4", "", -0.25),
    ("20%", "", 0.2), ("20 %", "", 0.2), ("15.8%", "", 0.158), ("20\u066a", "", 0.2), ("20%", "%", 20),
    ("20", "%", 20), ("1/2%", "", 0.005),
])
def test_numbers_fractions_and_percentages_are_read(text, unit, value):
    assert parse_number(text, unit) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text", ["", "twenty", "nan", "inf", "1e400", "3/0", "1/2/3", "3/", "/19", "%", "0,25",
                                  "1,5", "12,34", "20%%", "20 percent", "3//19"])
def test_anything_else_is_refused(text):
    assert parse_number(text) is None


def test_the_number_box_takes_a_percentage_or_a_fraction_and_says_what_it_takes(store):
    gpipe = QuestionView(_q("pipeline/gpipe-bubble"), store)  # the answer is a fraction, 0.2
    gpipe.control.value = "0,2"
    gpipe.check()
    assert "Enter a number, a fraction or a percentage, e.g. 0.25, 1.5e9, 3/19 or 20%" in gpipe.feedback.value
    assert "use a point for decimals" in gpipe.feedback.value and store.load() == {}
    gpipe.control.value = "20%"
    assert gpipe.check()["response"] == pytest.approx(0.2) and "✓ Correct." in gpipe.feedback.value
    inter = QuestionView(_q("pipeline/interleaved-bubble"), store)
    inter.control.value = "3 / 19"
    assert inter.check()["response"] == pytest.approx(3 / 19) and "✓ Correct." in inter.feedback.value
    assert QuestionView(_q("pipeline/interleaved-bubble"), store).control.value == f"{3 / 19:g}"  # as saved


def test_language_switch_keeps_the_answer_and_translates_everything(store):
    v = QuestionView(_q("fsdp/2"), store, "en")
    v.control.value = 1
    v.check()
    v.set_language("ms")
    assert "Operasi kolektif manakah" in v.text.value
    assert v.control.options[3] == ("d) Semua berkumpul", 1) and v.control.value == 1  # shown 4th, saved as 1
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
    assert "Score: 1/8 correct at the first attempt" in view.score_label.value
    assert view.preview_buttons[0].description.startswith("✓ 1.")
    view.views[1].control.value = 0
    view.views[1].check()
    view.views[1].control.value = 1
    view.views[1].check()  # right at the second attempt: ✓ in the preview, no point in the score
    assert view.preview_buttons[1].description.startswith("✓ 2.") and "Score: 1/8" in view.score_label.value
    view.next.click()
    assert "Question 2 of 8" in view.position.value and view.slot.children == (view.views[1].widget,)
    view.preview_buttons[7].click()
    assert "Question 8 of 8" in view.position.value and view.next.disabled
    view.picker.value = "ar"
    assert "سؤال 8 من 8" in view.position.value
    assert "lablib-rtl" in view.widget._dom_classes
    assert "صعب المستوى" in view.header.value
    assert "النتيجة: 1/8 صحيحة من المحاولة الأولى" in view.score_label.value
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
    quiz.score("00_welcome", store)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "00_welcome: 0/6 correct at the first attempt" and len(out) == 7
    assert out[1] == "  unanswered: welcome/rank: In torch.distributed, what is a rank?"
    assert out[4] == "  unanswered: welcome/backend: A machine has one GPU and you ask for 2…"
    for q in quiz.questions("00_welcome")[:4]:
        store.record(q.ref, sorted(q.answer) if q.type != "numeric" else q.answer, True, where=q.lab)
    store.record("welcome/mismatch", [0], False, where="00_welcome")
    quiz.score("00_welcome", store)
    assert capsys.readouterr().out == ("00_welcome: 4/6 correct at the first attempt\n"
                                       "  unanswered: welcome/collectives: Which of these must every rank of the "
                                       "group call…\n")  # a wrong answer is answered: only check() names it
    with pytest.raises(AssertionError) as info:
        quiz.check("00_welcome", store)
    msg = str(info.value)
    assert "not correct yet: welcome/mismatch" in msg and "unanswered: welcome/collectives" in msg
    store.record("welcome/mismatch", [1], True, where="00_welcome")
    store.record("welcome/collectives", [0, 1, 3], True, where="00_welcome")
    quiz.check("00_welcome", store)  # everything right now, though one only at the second attempt
    quiz.score("00_welcome", store)
    assert capsys.readouterr().out == "00_welcome: 5/6 correct at the first attempt\n"  # all answered: one line


def test_a_lab_name_gathers_seed_questions_placed_in_it(store, capsys):
    refs = [q.ref for q in quiz.questions("01_sharding")]
    assert {"fsdp/1", "fsdp/3", "fsdp/4", "fsdp/7", "fsdp/8"} <= set(refs)
    quiz.score("01_sharding", store)
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"01_sharding: 0/(\d+) correct at the first attempt", out[0])
    assert [line.split(": ")[1] for line in out[1:]] == refs and len(out) == len(refs) + 1


def test_the_stored_correct_flags_are_not_trusted(store, capsys):
    store.record("fsdp/2", [0], True)  # a hand-edited file claiming a wrong answer is right
    store.put("fsdp/6", {"response": [0], "first_response": [0], "first_correct": True, "correct": True,
                         "attempts": 1})
    quiz.score("fsdp/2", store)
    quiz.score("fsdp/6", store)
    assert capsys.readouterr().out == "fsdp/2: 0/1 correct at the first attempt\nfsdp/6: 0/1 correct at the first attempt\n"


def test_answers_in_the_whole_quiz_view_count_for_no_lab(store, capsys):
    view = quiz.show("fsdp", store=store)
    view.views[0].control.value = 0  # fsdp/1, right; its lab is 01_sharding
    view.views[0].check()
    assert "fsdp/1@quiz:fsdp" in store.load() and "fsdp/1" not in store.load()
    lab_view = quiz.ask("fsdp/1", store=store)
    assert lab_view.feedback.value == "" and lab_view.control.value is None  # not pre-answered
    quiz.score("01_sharding", store)
    quiz.score("fsdp", store)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("  unanswered: ")]
    assert out[0].startswith("01_sharding: 0/") and out[1] == "fsdp: 1/8 correct at the first attempt"
    with pytest.raises(AssertionError, match=r"unanswered: fsdp/1: What does FSDP shard .*\(answered only in the "
                                             r"whole-quiz view of 'fsdp', which does not count for a lab\)"):
        quiz.check("01_sharding", store)
    lab_view.control.value = 0
    lab_view.check()
    assert store.load()["fsdp/1"]["where"] == "01_sharding"
    other = quiz.ask("fsdp/3", store=store)
    other.control.value = 2
    other.check()  # answered in its lab: the whole-quiz view does not count it either
    again = quiz.show("fsdp", store=store)
    assert "Score: 1/8" in again.score_label.value and again.views[2].feedback.value == ""


def test_solve_is_the_instructors_not_the_learners(store, capsys):
    from lablib.course.key import solve

    assert not hasattr(quiz, "solve") and "solve" not in quiz.__all__
    solve("00_welcome", store)
    solve("fsdp", store)
    quiz.score("00_welcome", store)
    quiz.score("fsdp", store)
    assert capsys.readouterr().out == ("00_welcome: 6/6 correct at the first attempt\n"
                                       "fsdp: 8/8 correct at the first attempt\n")


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


@pytest.fixture
def exam(tmp_path, monkeypatch):
    """The learner's side of an exam: keyless copies of the banks, loaded through LABLIB_QUIZZES."""
    from lablib.course.release import keyless_bank

    folder = tmp_path / "exam-quizzes"
    folder.mkdir()
    for path in sorted((ROOT / "quizzes").glob("*.yaml")):
        (folder / path.name).write_text(keyless_bank(path), encoding="utf-8")
    monkeypatch.setenv("LABLIB_QUIZZES", str(folder))
    assert not quiz.banks()["fsdp"].keyed
    return folder


def test_an_exam_saves_answers_without_judging(exam, store, capsys):
    v = quiz.ask("fsdp/2", store=store)
    assert v.exam and v.check_button.description == "Save" and v.show_button.layout.display == "none"
    v.control.value = 0
    v.check_button.click()
    assert "Saved. You can change your answer until you hand in." in v.feedback.value
    assert not any(word in v.feedback.value for word in ("Correct", "Not quite", "Hint", "Answer:"))
    assert v.attempts.value == ""
    v.control.value = 1
    v.check()  # changed freely
    assert store.load()["fsdp/2"] == {"response": [1], "attempts": 2, "mode": "exam", "where": "02_collectives",
                                      "time": store.load()["fsdp/2"]["time"]}
    rebuilt = quiz.ask("fsdp/2", store=AnswerStore(store.path))
    assert rebuilt.control.value == 1 and "Your saved answer." in rebuilt.feedback.value
    quiz.score("02_collectives", store)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "02_collectives: 1/8 answered; your answers are saved and will be graded by your instructor"
    assert len(out) == 8 and "  unanswered: fsdp/6: " in "\n".join(out) and "fsdp/2:" not in "\n".join(out)
    with pytest.raises(AssertionError, match="unanswered: fsdp/6"):
        quiz.check("02_collectives", store)


def test_an_exam_quiz_view_counts_answers_not_points(exam, store):
    view = quiz.show("model-pipeline", store=store, lang="ar")
    assert "امتحان" in view.header.value and "تظهر الإجابات" not in view.header.value
    view.views[0].control.value = 3
    view.views[0].check()
    assert "تمت الإجابة: 1/8" in view.score_label.value and view.preview_buttons[0].description.startswith("• 1.")


def test_nothing_judges_without_a_key(exam, store):
    from lablib.course.key import solve

    (q,) = quiz.questions("fsdp/2")
    with pytest.raises(quiz.QuizError, match="no answer key in this bank"):
        QuestionView(q, store, exam=False)
    with pytest.raises(quiz.QuizError, match=r"exam copies with no answer key \(fsdp.yaml, sharding.yaml: mode: exam\)"
                                             r".*point LABLIB_QUIZZES at the instructor's keyed quizzes/ folder"):
        solve("01_sharding", store)
    with pytest.raises(quiz.QuizError, match="saved but not judged"):
        q.is_correct([1])
    assert store.load() == {}


def test_every_language_has_every_phrase_of_the_interface():
    from lablib.quiz.i18n import UI

    assert {lang: sorted(words) for lang, words in UI.items()} == {lang: sorted(UI["en"]) for lang in UI}
