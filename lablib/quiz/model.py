"""What a quiz is, once its bank is read (bank.py reads and validates the YAML): its questions, their
choices, keys and texts in each language, the order a learner sees the choices in, and how an answer
is judged right."""
from __future__ import annotations

import hashlib
import math
import string
from dataclasses import dataclass, field
from pathlib import Path


LANGUAGES = {"en": "English", "ms": "Bahasa Melayu", "ar": "العربية"}


RTL = {"ar"}


LEVELS = ("easy", "medium", "hard")


TYPES = ("single", "multiple", "numeric")


MODES = ("practice", "exam")


KEY_FIELDS = ("answer", "key", "tolerance", "explanation", "hint")  # what an exam copy leaves out


LETTERS = string.ascii_lowercase


_HINT_NEEDED = (": every question needs a hint, in every language of its quiz, shown after a wrong answer; it "
                "points at the idea without giving the answer")


class QuizError(ValueError):
    """One or more problems in quiz banks; ``problems`` lists them, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class Question:
    quiz: str
    id: str
    type: str
    text: dict
    explanation: dict
    tags: tuple
    lab: str
    choices: tuple = ()          # of {lang: text}
    answer: object = None        # frozenset of choice indices, or a float for numeric; None in an exam copy
    tolerance: float = 0.0
    unit: str = ""
    hint: dict = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """The global name of the question, e.g. "fsdp/2"."""
        return f"{self.quiz}/{self.id}"

    @property
    def keyed(self) -> bool:
        """Whether the bank holds this question's answer (an exam copy does not)."""
        return self.answer is not None

    def key(self, where: str) -> str:
        """The answers-file key of an answer given in ``where``: the ref in the question's own lab,
        ``ref@where`` anywhere else (e.g. ``fsdp/2@quiz:fsdp`` in the whole-quiz view)."""
        return self.ref if where == self.lab else f"{self.ref}@{where}"

    def valid_response(self, response) -> bool:
        """Whether ``response`` has the shape of an answer: a finite number for a numeric question, else
        a list of distinct choice indices (exactly one for a single-choice question)."""
        if self.type == "numeric":
            if not isinstance(response, (int, float)) or isinstance(response, bool):
                return False
            try:
                return math.isfinite(float(response))
            except OverflowError:  # an integer too large for a float
                return False
        if not isinstance(response, list) or not 0 < len(response) <= len(self.choices):
            return False
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(self.choices) for i in response):
            return False
        return len(set(response)) == len(response) and (self.type == "multiple" or len(response) == 1)

    def is_correct(self, response) -> bool:
        """``response``: a list of choice indices, or a number for numeric questions. Anything else is
        not correct. Raises QuizError for a question without its answer (an exam copy)."""
        if not self.keyed:
            raise QuizError([f"{self.ref}: this bank is an exam copy (mode: exam) with no answer key, so "
                             "answers can be saved but not judged here; the instructor grades them with the "
                             "keyed banks (lablib.quiz.grading.grade_lab)"])
        if not self.valid_response(response):
            return False
        if self.type == "numeric":
            return abs(float(response) - self.answer) <= self.tolerance + 1e-12 * abs(self.answer)
        return frozenset(response) == self.answer

    @property
    def order(self) -> tuple:
        """The bank indices of the choices in the order the learner sees them. Each question has a
        shuffle of its own, so that the right choice is not at the same letter everywhere (bank authors
        tend to write it first). It depends on the ref alone, through SHA-256 (Python's hash() changes
        from run to run): the same on every run, in every language and in an exam copy."""
        def rank(i):
            return hashlib.sha256(f"{self.ref}#{i}".encode()).digest()

        return tuple(sorted(range(len(self.choices)), key=rank))

    def shown(self, indices, lang: str) -> str:
        """Choices given by bank index, as the learner sees them: ``d) All-gather``, in the shown order."""
        return "; ".join(f"{LETTERS[k]}) {self.choices[i][lang]}" for k, i in enumerate(self.order) if i in indices)

    def response_text(self, response, lang: str = "en") -> str:
        """A valid response as the learner saw it: ``d) All-gather``, or ``25 ms``."""
        if self.type == "numeric":
            return f"{float(response):g}{(' ' + self.unit) if self.unit else ''}"
        return self.shown(set(response), lang)

    def answer_text(self, lang: str) -> str:
        """The right answer as the learner sees it: ``d) All-gather``, or ``25 ± 1 ms``."""
        if self.type == "numeric":
            tol = f" ± {self.tolerance:g}" if self.tolerance else ""
            return f"{self.answer:g}{tol}{(' ' + self.unit) if self.unit else ''}"
        return self.shown(self.answer, lang)


@dataclass(frozen=True)
class Quiz:
    id: str
    path: Path
    title: dict
    level: str
    description: dict
    lab: str
    languages: tuple
    questions: tuple
    related: dict = field(default_factory=dict)
    mode: str = "practice"       # "exam": a learner's copy without answer keys

    @property
    def keyed(self) -> bool:
        return self.mode != "exam"

    def question(self, qid: str) -> Question:
        for q in self.questions:
            if q.id == str(qid):
                return q
        raise KeyError(f"quiz {self.id!r} has no question {qid!r}; it has {', '.join(q.id for q in self.questions)}")
