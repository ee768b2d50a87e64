"""Quiz points from a learner's answers file, judged against the instructor's keyed banks.

    from lablib.quiz import AnswerStore, load_all
    from lablib.quiz.grading import feedback, grade_lab
    banks = load_all("quizzes")                        # the keyed banks, never a learner's copy
    answers = AnswerStore(path).load()                 # untrusted: any JSON
    items = grade_lab("01_sharding", answers, banks)   # one QuizItem per question placed in the lab
    report = feedback("01_sharding", answers, banks)   # markdown: answer, right answer, explanation

The rules (the answers file's record format is in store.py):

- Only answers given in the lab count for it: an answer given in the whole-quiz view
  (``quiz.show("fsdp")``) counts for no lab.
- Practice: a point for a question answered right at the first attempt, its answer not revealed: the
  first response is judged against the key, and a record whose ``first_correct`` is false scores
  nothing. A record from before first attempts were kept counts only if it has a single attempt.
- Exam (records marked ``"mode": "exam"``): a point for a right latest answer, however many times it
  was changed.
- A record that is not a mapping, or whose answer is not a finite number or a list of choices of the
  question, is an "invalid answer" worth 0; nothing in the file raises an exception.
"""
from __future__ import annotations

from dataclasses import dataclass

from .bank import Question, Quiz, QuizError

CORRECT, WRONG, UNANSWERED, REVEALED, INVALID = "correct", "wrong", "unanswered", "answer revealed", "invalid answer"


@dataclass
class QuizItem:
    ref: str             # "fsdp/2"
    status: str          # correct | wrong | unanswered | answer revealed | invalid answer | correct after N attempts
    points: float        # 1.0 or 0.0
    max_points: float    # 1.0
    attempts: int
    detail: str = ""


def pick(q: Question, answers, where: str) -> tuple[object, str]:
    """The record of ``q`` answered in ``where`` (None if there is none), and a note on an answer found
    only elsewhere."""
    if not isinstance(answers, dict):
        return None, "the answers file holds no answers"
    rec = answers.get(q.key(where))
    if isinstance(rec, dict) and rec.get("where", q.lab) != where:
        return None, f"answered in {_place_name(rec.get('where'))}, which does not count here"
    if rec is None:
        elsewhere = sorted(str(k).split("@", 1)[1] for k in answers if str(k).startswith(q.ref + "@"))
        if where == q.lab and elsewhere:
            return None, f"answered only in {', '.join(map(_place_name, elsewhere))}, which does not count for a lab"
    return rec, ""


def judge(q: Question, rec, mode: str | None = None) -> tuple[str, float, int]:
    """(status, points, attempts) of one record; ``mode`` "practice" or "exam" overrides the record's."""
    if not q.keyed:
        raise QuizError([f"{q.ref}: cannot grade with a keyless exam copy of the bank ({q.quiz}.yaml, mode: exam); "
                         "grade with the instructor's keyed banks (the course repository's quizzes/)"])
    if rec is None:
        return UNANSWERED, 0.0, 0
    if not isinstance(rec, dict):
        return INVALID, 0.0, 0
    attempts = rec.get("attempts")
    attempts = attempts if isinstance(attempts, int) and not isinstance(attempts, bool) and attempts >= 0 else None
    if "response" not in rec:
        return (REVEALED if rec.get("revealed") else UNANSWERED), 0.0, attempts or 0
    if attempts is None or not q.valid_response(rec["response"]):
        return INVALID, 0.0, attempts or 0
    if rec.get("revealed"):
        return REVEALED, 0.0, attempts
    right_now = q.is_correct(rec["response"])
    if (mode or ("exam" if rec.get("mode") == "exam" else "practice")) == "exam":
        return (CORRECT, 1.0, attempts) if right_now else (WRONG, 0.0, attempts)
    if "first_response" in rec:
        if attempts < 2 and rec["first_response"] != rec["response"]:  # two answers in one attempt
            return INVALID, 0.0, attempts
        right_first = q.is_correct(rec["first_response"])
    else:  # written before first attempts were kept: only a single attempt is known to be the first
        right_first = attempts == 1 and right_now
    right_first = right_first and rec.get("first_correct") is not False  # both the key and the record agree
    if right_first:
        return CORRECT, 1.0, attempts
    if right_now:
        return f"correct after {attempts} attempts", 0.0, attempts
    return WRONG, 0.0, attempts


def lab_questions(lab: str, banks: dict[str, Quiz]) -> list[Question]:
    """Every question placed in ``lab``, from any bank, in bank then question order."""
    return [q for name in sorted(banks) for q in banks[name].questions if q.lab == lab]


def grade_lab(lab: str, answers, banks: dict[str, Quiz], mode: str | None = None) -> list[QuizItem]:
    """One item per question placed in ``lab``, counting only answers given in that lab. ``answers`` is
    the raw "answers" mapping of a learner's quiz_answers.json (any JSON); ``banks`` the instructor's
    keyed banks (``load_all(dir)``); ``mode`` "practice" or "exam" applies that rule to every record
    instead of the one each record names. Raises QuizError only for keyless banks."""
    items = []
    for q in lab_questions(lab, banks):
        rec, note = pick(q, answers, lab)
        status, points, attempts = judge(q, rec, mode)
        detail = note or (f"attempts: {attempts}" if attempts else "")
        if status == INVALID:
            detail = "the saved answer is not one this question accepts"
        items.append(QuizItem(q.ref, status, points, 1.0, attempts, detail))
    return items


def feedback(lab: str, answers, banks: dict[str, Quiz], lang: str = "en") -> str:
    """Markdown for the learner's report: each question of ``lab``, their answer, the right answer and
    the explanation; choices carry the letters the learner saw (``Question.order``), not the bank's."""
    blocks = []
    for q, item in zip(lab_questions(lab, banks), grade_lab(lab, answers, banks)):
        lang_q = lang if lang in q.text else "en"
        rec, _ = pick(q, answers, lab)
        lines = [f"**{q.ref}** ({item.points:g}/{item.max_points:g}, {item.status}): {q.text[lang_q]}", ""]
        if item.status in (UNANSWERED, INVALID) or not isinstance(rec, dict):
            given = "(no answer)" if item.status == UNANSWERED else "(not a valid answer)"
        else:
            given = q.response_text(rec["response"], lang_q) if "response" in rec else "(no answer)"
            first = rec.get("first_response")
            if "first_response" in rec and first != rec.get("response") and q.valid_response(first):
                given += f" (first answer: {q.response_text(first, lang_q)})"
        lines += [f"- Your answer: {given}", f"- Right answer: {q.answer_text(lang_q)}",
                  f"- Why: {q.explanation[lang_q]}"]
        if item.detail and not item.detail.startswith("attempts"):
            lines.append(f"- Note: {item.detail}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + ("\n" if blocks else "")


def _place_name(where) -> str:
    if isinstance(where, str) and where.startswith("quiz:"):
        return f"the whole-quiz view of {where[5:]!r}"
    return f"lab {where}" if isinstance(where, str) else "an unknown place"
