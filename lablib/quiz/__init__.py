"""Auto-graded quizzes: banks in ``quizzes/``, widgets in the labs, answers saved beside the notebook.

    from lablib import quiz
    quiz.ask("fsdp/2")          # one question, where its idea is taught
    quiz.show("fsdp")           # a whole quiz, one question at a time
    quiz.score("01_sharding")   # "01_sharding: 7/10 correct at the first attempt", then what is unanswered
    quiz.check("01_sharding")   # raises AssertionError naming what is unanswered or wrong

A name is a quiz id (``fsdp``), a lab (``01_sharding``: every question placed in that lab, from any
bank) or one question (``fsdp/2``). Answers count where they were given: ``quiz.ask`` answers count
for the question's lab, ``quiz.show`` answers for that quiz view only (``quiz.score("fsdp")``).

Practice (the default): a question scores its point when answered right at the first attempt without
showing the answer. Exam (the banks are keyless copies, ``mode: exam``): answers are saved, not judged,
and the instructor grades them (``lablib.quiz.grading``). The banks are read from ``$LABLIB_QUIZZES``,
else from the repository's ``quizzes/``.
"""
from __future__ import annotations

from .bank import LANGUAGES, Question, Quiz, QuizError, default_dir, load, load_all
from .grading import judge, pick
from .i18n import pick_language, plain
from .store import AnswerStore

__all__ = ["ask", "show", "score", "check", "questions", "banks", "Question", "Quiz", "QuizError", "AnswerStore",
           "LANGUAGES", "load", "load_all"]

_cache: dict = {}


def banks(directory=None) -> dict[str, Quiz]:
    """All quiz banks (validated), reloaded when a file changes."""
    d = default_dir() if directory is None else directory
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(d.glob("*.yaml"))) if d.is_dir() else ()
    if _cache.get("key") != (str(d), stamp):
        _cache.update(key=(str(d), stamp), banks=load_all(d))
    return _cache["banks"]


def questions(name: str) -> list[Question]:
    """The questions a name stands for: a quiz id, a lab, or one question ref ("fsdp/2")."""
    all_banks = banks()
    if "/" in name:
        quiz_id, qid = name.split("/", 1)
        if quiz_id not in all_banks:
            raise KeyError(f"no quiz {quiz_id!r}; quizzes: {', '.join(sorted(all_banks))}")
        return [all_banks[quiz_id].question(qid)]
    if name in all_banks:
        return list(all_banks[name].questions)
    in_lab = [q for b in all_banks.values() for q in b.questions if q.lab == name]
    if not in_lab:
        labs = sorted({q.lab for b in all_banks.values() for q in b.questions})
        raise KeyError(f"{name!r} is neither a quiz ({', '.join(sorted(all_banks))}) nor a lab ({', '.join(labs)})")
    return in_lab


def place(name: str) -> str:
    """Where the answers that count for ``name`` are given: the lab (for a lab, or for one question:
    its lab), or ``quiz:<id>`` for a whole quiz."""
    if "/" in name:
        return questions(name)[0].lab
    return f"quiz:{name}" if name in banks() else name


def ask(ref: str, lang: str | None = None, store: AnswerStore | None = None):
    """One question (e.g. ``"fsdp/2"``) with a Check button; answers are saved as they are given, as
    answers given in the question's lab.

    Returns the view, which shows itself as a cell's last expression."""
    import ipywidgets as w

    from .bank import RTL
    from .widget import _STYLE, QuestionView, _language_picker

    (q,) = questions(ref) if "/" in ref else (None,)
    if q is None:
        raise ValueError(f"ask() takes one question, like 'fsdp/2', got {ref!r}; use show() for a whole quiz")
    quiz = banks()[q.quiz]
    view = QuestionView(q, store or AnswerStore(), pick_language(quiz.languages, lang), where=q.lab)
    box = w.VBox()
    box.add_class("lablib-quiz")

    def switch(language):
        view.set_language(language)
        (box.add_class if language in RTL else box.remove_class)("lablib-rtl")

    picker = _language_picker(quiz.languages, view.lang, switch)  # only for quizzes in several languages
    box.children = [w.HTML(_STYLE)] + ([picker] if picker else []) + [view.widget]
    switch(view.lang)
    view.outer, view.picker = box, picker
    return view


def show(quiz_id: str, lang: str | None = None, store: AnswerStore | None = None):
    """A whole quiz: level, title, description, related lab, one question at a time, the score. Its
    answers are its own: they count for no lab.

    Returns the view, which shows itself as a cell's last expression."""
    from .widget import QuizView

    all_banks = banks()
    if quiz_id not in all_banks:
        raise KeyError(f"no quiz {quiz_id!r}; quizzes: {', '.join(sorted(all_banks))}")
    return QuizView(all_banks[quiz_id], store or AnswerStore(), lang)


def _rows(name, store) -> tuple[list, bool]:
    """[(question, record or None, note)] for the answers that count for ``name`` (the note says where
    an answer that does not count was given), and whether the banks are exam copies (nothing can be
    judged)."""
    answers, where = (store or AnswerStore()).load(), place(name)
    qs = questions(name)
    return [(q, *pick(q, answers, where)) for q in qs], not all(q.keyed for q in qs)


def _answered(rec) -> bool:
    return isinstance(rec, dict) and "response" in rec


def _opening(q: Question, words: int = 10) -> str:
    """The first words of a question, enough to find the cell that asks it."""
    text = plain(q.text["en"]).split()
    return " ".join(text[:words]) + ("…" if len(text) > words else "")


def _unanswered(rows) -> list[str]:
    return [f"  unanswered: {q.ref}: {_opening(q)}" + (f" ({note})" if note else "")
            for q, rec, note in rows if not _answered(rec)]


def _line(name, rows) -> str:
    points = sum(judge(q, rec)[1] for q, rec, _ in rows)
    return f"{name}: {points:g}/{len(rows)} correct at the first attempt"


def score(name: str, store: AnswerStore | None = None) -> None:
    """Print one stable line for an nbval-checked cell: ``01_sharding: 7/10 correct at the first
    attempt`` (a question counts when answered right at the first attempt, its answer not shown); in an
    exam, how many questions are answered. Below it, one line for each question not answered yet, with
    the first words of its text; a lab answered in full (a solved source) prints the one line only."""
    rows, exam = _rows(name, store)
    if exam:
        answered = sum(_answered(rec) for _, rec, _ in rows)
        print(f"{name}: {answered}/{len(rows)} answered; your answers are saved and will be graded by your "
              f"instructor")
    else:
        print(_line(name, rows))
    for line in _unanswered(rows):
        print(line)


def check(name: str, store: AnswerStore | None = None) -> None:
    """Raise AssertionError naming every unanswered or wrong question of ``name`` (in an exam: every
    unanswered one)."""
    rows, exam = _rows(name, store)
    missing = [q for q, rec, _ in rows if not _answered(rec)]
    wrong = [] if exam else [q for q, rec, _ in rows if _answered(rec) and not q.is_correct(rec["response"])]
    if missing or wrong:
        lines = [f"{name}: {len(rows) - len(missing)}/{len(rows)} answered" if exam else _line(name, rows)]
        lines += _unanswered(rows)
        lines += [f"  not correct yet: {q.ref}: {_opening(q)}" for q in wrong]
        raise AssertionError("\n".join(lines))
