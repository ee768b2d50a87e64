"""Quiz banks: one YAML file per quiz in ``quizzes/``, loaded and validated.

A bank names its quiz (``id``, the file's stem), ``title``, ``level``, ``description``, the related
``lab``, its ``languages`` and its ``questions``. A question has an ``id``, ``text``, ``tags``, an
``explanation`` (shown with a right answer), a ``hint`` (shown after a wrong one: it points at the idea
without giving the answer), and either ``choices`` with an ``answer`` (choice letters, ``a`` first; one
for ``type: single``, the default, one or more for ``type: multiple``) or, for ``type: numeric``, a
number ``answer`` with a ``tolerance`` and an optional ``unit``. Texts are maps from language code to
text; a quiz in English only may use plain strings.

A numeric question's key is computed, not only typed: it names its inputs (``given``) and the key as an
expression of them (``key``), its texts write their figures as ``{expression}`` of the same inputs, and
the typed ``answer`` must be the key's value at the answer's own decimals (arith.py). Any question may
have ``given``, for its texts' figures.

The bank's letters name its own order. Learners see each question's choices in an order of its own
(``Question.order``: shuffled, the same on every run and in every language), lettered a), b), ... as
shown; answers are saved and graded as indices into the bank's order, never as shown positions. So an
explanation or hint names a choice by what it says, not by its letter.

A bank marked ``mode: exam`` is a learner's copy for an exam (``lablib release --quiz exam``): it
carries no ``answer``, ``tolerance``, ``explanation`` or ``hint``, and its questions cannot be judged.

Every problem is reported with file, question and field, all at once: ``QuizError`` lists them.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from .arith import ArithError, decimals, evaluate, render
from .model import (KEY_FIELDS, LANGUAGES, LETTERS, LEVELS, MODES, RTL, TYPES, Question, Quiz, QuizError,  # noqa: F401
                    _HINT_NEEDED)


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
    return validate(data, path)


def validate(data, path: str | Path) -> Quiz:
    """The quiz a bank's parsed YAML describes (``path`` names its file); raises QuizError."""
    return _Validator(Path(path)).quiz(data)


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
        self.mode = data.get("mode", "practice")
        if self.mode not in MODES:
            self.err("field 'mode'", f"{self.mode!r} is not one of {', '.join(MODES)} (leave it out for practice)")
            self.mode = "practice"
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
        return Quiz(qid, self.path, title, level, description, lab, tuple(langs), tuple(questions), related,
                    self.mode)

    def text(self, value, where, names=None) -> dict:
        """A {lang: text} map with every quiz language; a plain string counts as English. With ``names`` (a
        question's inputs), each text's ``{expression}`` figures are computed from them."""
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
        texts = {lang: str(value.get(lang, "")).strip() for lang in self.langs}
        if names is None:
            return texts
        try:
            return {lang: render(text, names) for lang, text in texts.items()}
        except ArithError as e:
            self.err(where, f"a figure cannot be computed: {e}")
            return texts

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
        exam = self.mode == "exam"
        for key in ("text", "tags") + (() if exam else ("explanation", "hint", "answer")):
            if key not in q:
                self.err(where, f"field {key!r} missing" + (_HINT_NEEDED if key == "hint" else ""))
        qtype = q.get("type", "single")
        if qtype not in TYPES:
            self.err(where, f"field 'type': {qtype!r} is not one of {', '.join(TYPES)}")
            return None
        self.names = self.given(q, where)
        text = self.text(q.get("text"), f"{where}: field 'text'", self.names)
        tags = q.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            self.err(where, "field 'tags': must be a list of words")
            tags = []
        lab = q.get("lab", quiz_lab)
        common = dict(quiz=quiz_id, id=qid, type=qtype, text=text, tags=tuple(tags), lab=lab)
        if exam:
            return self.keyless(q, where, common)
        if "hint" in q:
            common["hint"] = self.text(q.get("hint"), f"{where}: field 'hint'", self.names)
        if qtype == "numeric":
            return self.numeric(q, where, common)
        common["explanation"] = self.text(q.get("explanation"), f"{where}: field 'explanation'", self.names)
        return self.choice(q, where, qtype, common)

    def given(self, q, where) -> dict | None:
        """The question's inputs, {name: number}, or None when it names none."""
        given = q.get("given")
        if given is None:
            if "key" in q and self.mode != "exam":
                self.err(where, "field 'key': an expression needs its inputs in 'given', e.g. given: {tokens: 4096}")
            return None
        if not isinstance(given, dict) or not all(isinstance(k, str) and k.isidentifier() and k != "key" and _is_number(v)
                                                  for k, v in given.items()):
            self.err(where, "field 'given': must map names (not 'key') to numbers, e.g. given: {tokens: 4096, k: 2}")
            return None
        return dict(given)

    def key(self, q, where, answer) -> dict | None:
        """The names the explanation may use (the inputs and ``key``), once the key is computed and the typed
        answer agrees with it; None (the problem reported) otherwise."""
        if "key" not in q:
            self.err(where, "field 'key' missing: a numeric answer is computed from its inputs, e.g. given: {tokens: "
                            "4096, k: 2} and key: tokens * k / 8, and the explanation's figures from the same inputs")
            return None
        try:
            value = evaluate(q["key"], self.names or {})
        except ArithError as e:
            self.err(where, f"field 'key': {e}")
            return None
        places = decimals(answer)
        if abs(round(value, places) - answer) > 1e-9 * max(1.0, abs(answer)):
            self.err(where, f"field 'answer': {answer:g}, but the key {q['key']} is {value:.6g} ({round(value, places):.{places}f} "
                            f"at the answer's {places} decimals): correct the answer, the key or its inputs")
            return None
        return {**(self.names or {}), "key": value}

    def keyless(self, q, where, common) -> Question | None:
        """A question of an exam copy: everything but the key, which must not be there."""
        for key in KEY_FIELDS:
            if key in q:
                self.err(where, f"field {key!r}: an exam bank (mode: exam) carries no answer key, explanation "
                                "or hint; remove it (lablib release --quiz exam writes keyless copies)")
        if common["type"] == "numeric":
            if "choices" in q:
                self.err(where, "field 'choices': a numeric question has no choices")
                return None
            return Question(**common, explanation={}, unit=str(q.get("unit", "")))
        choices = q.get("choices")
        if not isinstance(choices, list) or len(choices) < 2:
            self.err(where, "field 'choices': needs a list of at least 2 choices")
            return None
        texts = tuple(self.text(c, f"{where}: choice {LETTERS[j]}", self.names) for j, c in enumerate(choices[:26]))
        return Question(**common, explanation={}, choices=texts)

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
        names = self.key(q, where, float(answer)) if ok else None
        common["explanation"] = self.text(q.get("explanation"), f"{where}: field 'explanation'", names or self.names)
        if not ok or names is None:
            return None
        shown = _number_in(common.get("hint", {}), float(answer))
        if shown:
            self.err(where, f"field 'hint': the {shown} hint states the answer ({float(answer):g}); point at the "
                            "idea or the method instead")
        return Question(**common, answer=float(answer), tolerance=float(tolerance), unit=str(q.get("unit", "")))

    def choice(self, q, where, qtype, common) -> Question | None:
        choices = q.get("choices")
        if not isinstance(choices, list):
            self.err(where, "field 'choices' missing" if choices is None else "field 'choices': must be a list")
            return None
        if len(choices) < 2:
            self.err(where, f"field 'choices': needs at least 2 choices, got {len(choices)}")
            return None
        texts = tuple(self.text(c, f"{where}: choice {LETTERS[j]}", self.names) for j, c in enumerate(choices[:26]))
        for key in ("explanation", "hint"):
            lang, letter = _letter_in(common.get(key, {}), len(texts))
            if letter:
                self.err(where, f"field {key!r}: the {lang} text names a choice by its letter, {letter}; learners "
                                "see the choices in another order, with other letters: name it by what it says")
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


def _letter_in(texts: dict, n: int) -> tuple[str, str]:
    """(language, "(b)") for the first text that names one of ``n`` choices as (a), (b), ...; else ("", "")."""
    for lang, text in texts.items():
        for m in re.finditer(r"(?<![\w(])\(([a-z])\)", text):  # "(b)", not "f(x)"
            if LETTERS.index(m.group(1)) < n:
                return lang, m.group(0)
    return "", ""


def _number_in(texts: dict, number: float) -> str:
    """The language of the first text that writes ``number`` as a number of its own, else ""."""
    pattern = re.compile(rf"(?<![\w.]){re.escape(f'{number:g}')}(?!\d|[.,]\d)")
    return next((lang for lang, text in texts.items() if pattern.search(text)), "")
