"""Quiz banks: one YAML file per quiz in ``quizzes/``, loaded and validated.

A bank names its quiz (``id``, the file's stem), ``title``, ``level``, ``description``, the related
``lab``, its ``languages`` and its ``questions``. A question has an ``id``, ``text``, ``tags``, an
``explanation``, and either ``choices`` with an ``answer`` (choice letters, ``a`` first; one for
``type: single``, the default, one or more for ``type: multiple``) or, for ``type: numeric``, a number
``answer`` with a ``tolerance``. Texts are maps from language code to text; a quiz in English only may
use plain strings.

Every problem is reported with file, question and field, all at once: ``QuizError`` lists them.
"""
from __future__ import annotations

import math
import os
import string
from dataclasses import dataclass, field
from pathlib import Path

LANGUAGES = {"en": "English", "ms": "Bahasa Melayu", "ar": "العربية"}
RTL = {"ar"}
LEVELS = ("easy", "medium", "hard")
TYPES = ("single", "multiple", "numeric")
LETTERS = string.ascii_lowercase


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
    answer: object = None        # frozenset of choice indices, or a float for numeric
    tolerance: float = 0.0
    unit: str = ""

    @property
    def ref(self) -> str:
        """The global name of the question, e.g. "fsdp/2"."""
        return f"{self.quiz}/{self.id}"

    def is_correct(self, response) -> bool:
        """``response``: a list of choice indices, or a number for numeric questions."""
        if response is None:
            return False
        if self.type == "numeric":
            try:
                return abs(float(response) - self.answer) <= self.tolerance + 1e-12 * abs(self.answer)
            except (TypeError, ValueError):
                return False
        try:
            return frozenset(int(i) for i in response) == self.answer
        except (TypeError, ValueError):
            return False

    def status(self, record: dict | None) -> str:
        """"correct", "wrong" or "unanswered" for an answers-file record, graded against the bank (the
        record's own "correct" flag is not trusted)."""
        if record is None:
            return "unanswered"
        return "correct" if self.is_correct(record.get("response")) else "wrong"

    def answer_text(self, lang: str) -> str:
        if self.type == "numeric":
            tol = f" ± {self.tolerance:g}" if self.tolerance else ""
            return f"{self.answer:g}{tol}{(' ' + self.unit) if self.unit else ''}"
        return "; ".join(f"{LETTERS[i]}) {self.choices[i][lang]}" for i in sorted(self.answer))


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

    def question(self, qid: str) -> Question:
        for q in self.questions:
            if q.id == str(qid):
                return q
        raise KeyError(f"quiz {self.id!r} has no question {qid!r}; it has {', '.join(q.id for q in self.questions)}")


def default_dir() -> Path:
    """``$LABLIB_QUIZZES``, else ``quizzes/`` at the root of this repository."""
    env = os.environ.get("LABLIB_QUIZZES")
    from ..paths import QUIZZES

    return Path(env) if env else QUIZZES


def load_all(directory: str | Path | None = None) -> dict[str, Quiz]:
    """Every ``*.yaml`` bank in ``directory``, validated; raises QuizError listing all problems."""
    directory = Path(directory) if directory is not None else default_dir()
    if not directory.is_dir():
        raise QuizError([f"{directory}: no such quiz folder (set LABLIB_QUIZZES, or run from the repository)"])
    quizzes, problems = {}, []
    for path in sorted(directory.glob("*.yaml")):
        try:
            quiz = load(path)
        except QuizError as e:
            problems += e.problems
            continue
        quizzes[quiz.id] = quiz  # ids match file names, so they are unique
    if problems:
        raise QuizError(problems)
    return quizzes


def load(path: str | Path) -> Quiz:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise QuizError([f"{path}: not valid YAML: {e}"]) from None
    except OSError as e:
        raise QuizError([f"{path}: cannot read: {e}"]) from None
    return _Validator(path).quiz(data)


class _Validator:
    def __init__(self, path: Path):
        self.path, self.problems = path, []

    def err(self, where: str, message: str):
        self.problems.append(f"{self.path}: {where}: {message}")

    def quiz(self, data) -> Quiz:
        if not isinstance(data, dict):
            raise QuizError([f"{self.path}: expected a mapping with id, title, level, ... at the top"])
        for key in ("id", "title", "level", "description", "lab", "languages", "questions"):
            if key not in data:
                self.err(f"field {key!r}", "missing")
        qid = str(data.get("id", ""))
        if "id" in data and qid != self.path.stem:
            self.err("field 'id'", f"{qid!r} must match the file name ({self.path.stem!r})")
        langs = data.get("languages", ["en"])
        if not isinstance(langs, list) or not langs:
            self.err("field 'languages'", "must be a list of language codes, e.g. [en, ms]")
            langs = ["en"]
        for lang in langs:
            if lang not in LANGUAGES:
                self.err("field 'languages'", f"unknown language {lang!r}; known: {', '.join(LANGUAGES)}")
        if "en" not in langs:
            self.err("field 'languages'", "every quiz needs English ('en')")
        langs = [lang for lang in langs if lang in LANGUAGES]
        self.langs = langs
        level = data.get("level")
        if "level" in data and level not in LEVELS:
            self.err("field 'level'", f"{level!r} is not one of {', '.join(LEVELS)}")
        title = self.text(data.get("title"), "field 'title'")
        description = self.text(data.get("description"), "field 'description'")
        related = self.text(data["related"], "field 'related'") if "related" in data else {}
        lab = data.get("lab")
        if "lab" in data and not (isinstance(lab, str) and lab):
            self.err("field 'lab'", "must name the related lab, e.g. 01_sharding")
        questions, seen = [], set()
        raw = data.get("questions")
        if "questions" in data and (not isinstance(raw, list) or not raw):
            self.err("field 'questions'", "must be a non-empty list")
            raw = []
        for i, q in enumerate(raw or []):
            question = self.question(q, i, qid, lab, seen)
            if question is not None:
                questions.append(question)
        if self.problems:
            raise QuizError(self.problems)
        return Quiz(qid, self.path, title, level, description, lab, tuple(langs), tuple(questions), related)

    def text(self, value, where) -> dict:
        """A {lang: text} map with every quiz language; a plain string counts as English."""
        if isinstance(value, str) and value.strip():
            value = {"en": value}
        if not isinstance(value, dict):
            self.err(where, "missing" if value is None else f"expected text or a map of language -> text, got {value!r}")
            return {}
        for lang in value:
            if lang not in self.langs:
                hint = "" if lang in LANGUAGES else "; in YAML, quote a text that contains ': '"
                self.err(where, f"unknown language {lang!r} (this quiz has {', '.join(self.langs)}){hint}")
        for lang in self.langs:
            if not (isinstance(value.get(lang), str) and value[lang].strip()):
                self.err(where, f"missing language {lang!r}")
        return {lang: str(value.get(lang, "")).strip() for lang in self.langs}

    def question(self, q, i, quiz_id, quiz_lab, seen) -> Question | None:
        if not isinstance(q, dict):
            self.err(f"question #{i + 1}", "expected a mapping with id, text, choices, answer, ...")
            return None
        if "id" not in q:
            self.err(f"question #{i + 1}", "field 'id' missing")
            return None
        qid = str(q["id"])
        where = f"question {qid}"
        if qid in seen:
            self.err(where, "duplicate question id")
        seen.add(qid)
        for key in ("text", "explanation", "tags", "answer"):
            if key not in q:
                self.err(where, f"field {key!r} missing")
        qtype = q.get("type", "single")
        if qtype not in TYPES:
            self.err(where, f"field 'type': {qtype!r} is not one of {', '.join(TYPES)}")
            return None
        text = self.text(q.get("text"), f"{where}: field 'text'")
        explanation = self.text(q.get("explanation"), f"{where}: field 'explanation'")
        tags = q.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            self.err(where, "field 'tags': must be a list of words")
            tags = []
        lab = q.get("lab", quiz_lab)
        common = dict(quiz=quiz_id, id=qid, type=qtype, text=text, explanation=explanation, tags=tuple(tags),
                      lab=lab)
        if qtype == "numeric":
            return self.numeric(q, where, common)
        return self.choice(q, where, qtype, common)

    def numeric(self, q, where, common) -> Question | None:
        answer, tolerance = q.get("answer"), q.get("tolerance")
        ok = True
        if "choices" in q:
            self.err(where, "field 'choices': a numeric question has no choices")
            ok = False
        if not _is_number(answer):
            if "answer" in q:
                self.err(where, f"field 'answer': a numeric question needs a number, got {answer!r}")
            ok = False
        if tolerance is None:
            self.err(where, "field 'tolerance' missing: a numeric answer needs one (0 for exact)")
            ok = False
        elif not _is_number(tolerance) or tolerance < 0:
            self.err(where, f"field 'tolerance': must be a number >= 0, got {tolerance!r}")
            ok = False
        if not ok:
            return None
        return Question(**common, answer=float(answer), tolerance=float(tolerance), unit=str(q.get("unit", "")))

    def choice(self, q, where, qtype, common) -> Question | None:
        choices = q.get("choices")
        if not isinstance(choices, list):
            self.err(where, "field 'choices' missing" if choices is None else "field 'choices': must be a list")
            return None
        if len(choices) < 2:
            self.err(where, f"field 'choices': needs at least 2 choices, got {len(choices)}")
            return None
        texts = tuple(self.text(c, f"{where}: choice {LETTERS[j]}") for j, c in enumerate(choices[:26]))
        answer = q.get("answer")
        letters = answer if isinstance(answer, list) else ([] if answer is None else [answer])
        indices = set()
        for a in letters:
            if not (isinstance(a, str) and len(a) == 1 and a in LETTERS[:len(choices)]):
                self.err(where, f"field 'answer': {a!r} is not a choice letter (a-{LETTERS[len(choices) - 1]})")
                return None
            indices.add(LETTERS.index(a))
        if not indices:
            if "answer" in q:
                self.err(where, "field 'answer': no correct choice given")
            return None
        if qtype == "single" and (len(indices) != 1 or isinstance(answer, list) and len(answer) != 1):
            self.err(where, f"field 'answer': a single-choice question needs exactly one correct choice, got "
                            f"{', '.join(sorted(LETTERS[i] for i in indices))} (use type: multiple for several)")
            return None
        return Question(**common, choices=texts, answer=frozenset(indices))


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
