"""The quiz answer key, on the instructor's side: a solved source notebook records it (in a
``source-only`` cell) so that it scores in full under nbval. Not part of the learner's ``lablib.quiz``.

    from lablib.course.key import solve
    solve("01_sharding")   # every question placed in the lab, answered right at the first attempt
"""
from __future__ import annotations

import time

from ..quiz import AnswerStore, QuizError, default_dir, place, questions


def solve(name: str, store: AnswerStore | None = None) -> None:
    """Record the right answer to every question of ``name`` (a lab, a quiz id or one question), as
    answered at the first attempt where answers to ``name`` count. Refuses keyless exam banks."""
    qs = questions(name)
    keyless = sorted({q.quiz for q in qs if not q.keyed})
    if keyless:
        raise QuizError([f"solve({name!r}): the quiz banks in {default_dir()} are exam copies with no answer key "
                         f"({', '.join(f'{b}.yaml' for b in keyless)}: mode: exam). Run it in the course repository, "
                         "or point LABLIB_QUIZZES at the instructor's keyed quizzes/ folder."])
    store = store or AnswerStore()
    where = place(name)
    for q in qs:
        answer = q.answer if q.type == "numeric" else sorted(q.answer)
        store.put(q.key(where), {"response": answer, "where": where, "attempts": 1, "first_response": answer,
                                 "first_correct": True, "correct": True, "revealed": False,
                                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
