"""Quiz widgets built from core ipywidgets controls only, so they run in JupyterLab, VS Code and Colab.

``QuestionView``: one question, where its idea is taught. ``QuizView``: a whole quiz, the way the
seed quizzes present it (level, title, description, related guide, "question k of N" with next and
previous, a preview of every question, feedback as you answer, a running score).
"""
from __future__ import annotations

import math
import re

import ipywidgets as w

from .bank import LANGUAGES, LETTERS, RTL, Question, Quiz, QuizError
from .grading import CORRECT, judge, pick
from .i18n import pick_language, plain, rich, t
from .store import AnswerStore

# Right-to-left layout for Arabic, applied by a class on the quiz's outer box.
_STYLE = ("<style>.lablib-rtl, .lablib-rtl * {direction: rtl; text-align: right;} "
          ".lablib-rtl .widget-radio-box input {float: right; margin: 0 1px 0 8px;} "  # ipywidgets floats it left
          ".lablib-quiz .widget-radio-box label, .lablib-quiz .widget-checkbox label {white-space: normal; height: auto; "
          "min-height: var(--jp-widgets-inline-height);} "  # a wrapped choice grows instead of overprinting,
          ".lablib-quiz .widget-radio-box label {display: flex; align-items: flex-start;} "  # and its button stays
          ".lablib-quiz .widget-radio-box input {flex: none; margin-top: 3px;}</style>")  # beside its first line
_GROUPED = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?([eE][+-]?\d+)?")  # 1,000,000.5


def parse_number(text: str, unit: str = "") -> float | None:
    """The number typed in a numeric question's box, or None when it is not one. Accepted: a number
    (``0.25``, ``-3``, ``1.5e9``, ``1,000,000``, ``1_000``), a fraction (``3/19``, ``3 / 19``) and a
    percentage: a trailing ``%`` means hundredths (``20%`` is 0.2, for an answer that is a fraction),
    unless the question's ``unit`` is ``%``, where ``20%`` is 20, as ``20`` is. A comma is read only
    between groups of three digits: ``0,25`` is refused rather than taken for 25."""
    text = str(text).strip().replace("_", "")
    per = 1.0
    if text[-1:] in ("%", "\u066a"):  # the Arabic percent sign too
        text, per = text[:-1].rstrip(), (1.0 if unit.strip() == "%" else 100.0)
    parts = [_plain_number(p) for p in text.split("/")]
    if len(parts) > 2 or None in parts or (len(parts) == 2 and parts[1] == 0):
        return None
    value = (parts[0] / parts[1] if len(parts) == 2 else parts[0]) / per
    return value if math.isfinite(value) else None


def _plain_number(text: str) -> float | None:
    text = text.strip()
    if "," in text:
        if not _GROUPED.fullmatch(text):
            return None
        text = text.replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class QuestionView:
    """One question: its text, the choices (or a number box), a Check button, feedback and attempts.

    Practice (a keyed bank): a wrong answer shows a hint, a right one the explanation; *Show answer*
    shows the answer and the explanation and gives up the question's point. Exam (a keyless bank,
    ``mode: exam``): a Save button, nothing judged. Every answer is saved to the answers file under
    the place it was given (``where``: the question's lab by default); a rebuilt view shows it again.

    The choices are shown in the question's own order (``Question.order``), lettered as shown. The
    controls speak bank indices: the radio buttons' values, and ``boxes[i]`` for bank choice ``i``
    (``control.children`` holds them as shown), so what is saved and graded is the choice, not where
    it stood.
    """

    def __init__(self, question: Question, store: AnswerStore, lang: str = "en", on_answer=None,
                 where: str | None = None, exam: bool | None = None):
        if exam is None:
            exam = not question.keyed
        if not exam and not question.keyed:
            raise QuizError([f"{question.ref}: no answer key in this bank (an exam copy, mode: exam), so a "
                             "practice view cannot judge it; leave exam= out to save answers without judging"])
        self.q, self.store, self.lang, self.on_answer, self.exam = question, store, lang, on_answer, exam
        self.where = question.lab if where is None else where
        self.key = question.key(self.where)
        self.text = w.HTML()
        self.note = w.HTML()  # "Select all that apply."
        if question.type == "single":
            self.control = w.RadioButtons(options=[], value=None, layout=w.Layout(width="auto"))
            self.boxes = []
        elif question.type == "multiple":
            self.boxes = [w.Checkbox(value=False, indent=False, layout=w.Layout(width="auto")) for _ in question.choices]
            self.control = w.VBox([self.boxes[i] for i in question.order])
        else:
            self.control = w.Text(layout=w.Layout(width="16em"))
            self.boxes = []
        self.unit = w.Label(question.unit)
        self.check_button = w.Button(button_style="primary")
        self.check_button.on_click(lambda _: self.check())
        self.show_button = w.Button(layout=w.Layout(display="none"))
        self.show_button.on_click(lambda _: self.reveal())
        self.feedback = w.HTML()
        self.attempts = w.Label()
        entry = w.HBox([self.control, self.unit]) if question.type == "numeric" else self.control
        buttons = w.HBox([self.check_button, self.show_button, self.attempts])
        self.widget = w.VBox([self.text, self.note, entry, buttons, self.feedback])
        self.widget.add_class("lablib-question")
        self.outer = self.widget  # what is displayed; ask() wraps it with the style box
        self._restored = False    # the feedback shown is a saved answer's, not one given just now
        self.set_language(lang)
        self._restore()

    def _repr_mimebundle_(self, **kwargs):
        return self.outer._repr_mimebundle_(**kwargs)

    def record(self) -> dict | None:
        """This view's record in the answers file (None when there is none, or it is not a record)."""
        rec = self.store.get(self.key)
        return rec if isinstance(rec, dict) else None

    # -- language --------------------------------------------------------------------------------
    def set_language(self, lang: str):
        self.lang = lang
        q = self.q
        self.text.value = f"<div><b>{rich(q.text[lang])}</b></div>"
        self.note.value = f"<i>{t(lang, 'several')}</i>" if q.type == "multiple" else ""
        if q.type == "single":
            value = self.control.value
            self.control.options = [(f"{LETTERS[k]}) {plain(q.choices[i][lang])}", i) for k, i in enumerate(q.order)]
            self.control.value = value
        elif q.type == "multiple":
            for k, i in enumerate(q.order):
                self.boxes[i].description = f"{LETTERS[k]}) {plain(q.choices[i][lang])}"
        else:
            self.control.placeholder = t(lang, "number")
        self.check_button.description = t(lang, "save" if self.exam else "check")
        self.show_button.description, self.show_button.tooltip = t(lang, "show_answer"), t(lang, "show_tip")
        self._show(self.record(), saved=self._restored)

    # -- answering -------------------------------------------------------------------------------
    def response(self):
        """What is selected now: a list of choice indices, a number, or None (nothing valid)."""
        if self.q.type == "single":
            return None if self.control.value is None else [self.control.value]
        if self.q.type == "multiple":
            picked = [i for i, b in enumerate(self.boxes) if b.value]
            return picked or None
        return parse_number(self.control.value, self.q.unit)

    def check(self):
        """Save what is selected (and judge it, in practice); returns the record, or None if nothing
        valid is selected."""
        response = self.response()
        if response is None:
            key = "not_a_number" if self.q.type == "numeric" and self.control.value.strip() else "choose"
            self.feedback.value = f"<span style='color:#b45309'>{t(self.lang, key)}</span>"
            return None
        correct = None if self.exam else self.q.is_correct(response)
        rec = self.store.record(self.key, response, correct, self.where)
        self._restored = False
        self._show(rec, saved=False)
        if self.on_answer:
            self.on_answer(self)
        return rec

    def reveal(self) -> dict:
        """Show the answer and the explanation; the question then scores no point."""
        if self.exam:
            raise QuizError([f"{self.q.ref}: an exam has no answers to show"])
        rec = self.store.reveal(self.key, self.where)
        self._restored = False
        self._show(rec, saved=False)
        if self.on_answer:
            self.on_answer(self)
        return rec

    def _restore(self):
        rec = self.record()
        if rec is None or "response" not in rec:
            return
        r = rec["response"]
        if self.q.valid_response(r):  # an answer from another version of the question leaves the control
            if self.q.type == "single":
                self.control.value = r[0]
            elif self.q.type == "multiple":
                for i, box in enumerate(self.boxes):
                    box.value = i in r
            else:
                self.control.value = f"{float(r):g}"
        self._restored = True
        self._show(rec, saved=True)

    def _show(self, rec, saved):
        lang, q = self.lang, self.q
        rec = rec if isinstance(rec, dict) else {}
        answered = "response" in rec
        note = f" <i>{t(lang, 'saved')}</i>" if saved else ""
        self.attempts.value = t(lang, "attempts", n=rec.get("attempts", 1)) if answered and not self.exam else ""
        if self.exam:
            self.feedback.value = f"<div><b>{t(lang, 'saved_now')}</b>{note}</div>" if answered else ""
            return
        right = answered and q.is_correct(rec["response"])
        revealed = bool(rec.get("revealed"))
        self.show_button.layout.display = "none" if right or revealed else None
        parts = []
        if answered:
            parts.append((f"<b style='color:#15803d'>✓ {t(lang, 'correct')}</b>" if right else
                          f"<b style='color:#b91c1c'>✗ {t(lang, 'incorrect')}</b>") + note)
        if revealed:
            parts += [f"<b>{rich(t(lang, 'answer_is', answer=q.answer_text(lang)))}</b>", rich(q.explanation[lang]),
                      f"<i>{t(lang, 'revealed')}</i>"]
        elif right:
            parts.append(rich(q.explanation[lang]))
            if judge(q, rec)[0] != CORRECT:
                parts.append(f"<i>{t(lang, 'late')}</i>")
        elif answered:
            parts.append(f"<b>{t(lang, 'hint')}</b> {rich(q.hint[lang])}")
        self.feedback.value = f"<div>{'<br>'.join(parts)}</div>" if parts else ""

    @property
    def correct(self) -> bool:
        """Whether the latest answer is right (practice)."""
        rec = self.record()
        return bool(rec) and "response" in rec and self.q.is_correct(rec["response"])


def _language_picker(quiz_langs, lang, on_change):
    if len(quiz_langs) < 2:
        return None
    picker = w.ToggleButtons(options=[(LANGUAGES[code], code) for code in quiz_langs], value=lang,
                             style={"button_width": "auto"})
    picker.observe(lambda change: on_change(change["new"]), names="value")
    return picker


class QuizView:
    """A whole quiz: header, language switch, one question at a time, a preview of all, the score.

    Its answers are kept apart from the labs' (``where`` is ``quiz:<id>``): they count for no lab."""

    def __init__(self, quiz: Quiz, store: AnswerStore, lang: str | None = None, start: int = 0):
        self.quiz, self.store, self.exam = quiz, store, not quiz.keyed
        self.where = f"quiz:{quiz.id}"
        self.lang = pick_language(quiz.languages, lang)
        self.views = [QuestionView(q, store, self.lang, on_answer=lambda _: self._refresh(), where=self.where)
                      for q in quiz.questions]
        self.k = max(0, min(start, len(self.views) - 1))
        self.header = w.HTML()
        self.position = w.HTML()
        self.slot = w.Box()
        self.prev = w.Button(icon="arrow-left")
        self.next = w.Button(icon="arrow-right")
        self.prev.on_click(lambda _: self.go(self.k - 1))
        self.next.on_click(lambda _: self.go(self.k + 1))
        self.score_label = w.HTML()
        self.preview_buttons = [w.Button(layout=w.Layout(width="100%")) for _ in self.views]
        for i, b in enumerate(self.preview_buttons):
            b.on_click(lambda _, i=i: self.go(i))
        self.preview = w.Accordion(children=[w.VBox(self.preview_buttons)], selected_index=None)
        self.picker = _language_picker(quiz.languages, self.lang, self.set_language)
        rows = [w.HTML(_STYLE), self.header] + ([self.picker] if self.picker else []) + [
            self.position, self.slot, w.HBox([self.prev, self.next, self.score_label]), self.preview]
        self.widget = w.VBox(rows, layout=w.Layout(border="1px solid #ddd", padding="8px"))
        self.widget.add_class("lablib-quiz")
        self.set_language(self.lang)
        self.go(self.k)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def set_language(self, lang: str):
        self.lang = lang
        if lang in RTL:
            self.widget.add_class("lablib-rtl")
        else:
            self.widget.remove_class("lablib-rtl")
        self.prev.icon, self.next.icon = ("arrow-right", "arrow-left") if lang in RTL else ("arrow-left", "arrow-right")
        for v in self.views:
            v.set_language(lang)
        quiz = self.quiz
        link = f"<a href='{quiz.lab}.ipynb' target='_blank'>{rich(quiz.related.get(lang) or quiz.lab)}</a>"
        self.header.value = (
            f"<div style='color:#666'>{t(lang, 'header', level=t(lang, 'levels')[quiz.level])}</div>"
            f"<h3 style='margin:4px 0'>{rich(quiz.title[lang])}</h3>"
            f"<div>{rich(quiz.description[lang])}</div>"
            f"<div>{t(lang, 'related', related=link)}</div>"
            f"<div style='color:#666'><i>{t(lang, 'exam_note' if self.exam else 'note')}</i></div>")
        self.prev.description, self.next.description = t(lang, "previous"), t(lang, "next")
        self.preview.set_title(0, t(lang, "preview", n=len(self.views)))
        self._refresh()

    def go(self, k: int):
        self.k = max(0, min(k, len(self.views) - 1))
        self.slot.children = [self.views[self.k].widget]
        self.prev.disabled, self.next.disabled = self.k == 0, self.k == len(self.views) - 1
        self._refresh()

    def _refresh(self):
        lang, answers = self.lang, self.store.load()
        self.position.value = f"<b>{t(lang, 'position', k=self.k + 1, n=len(self.views))}</b>"
        points = answered = 0
        for i, (v, b) in enumerate(zip(self.views, self.preview_buttons)):
            rec, _ = pick(v.q, answers, self.where)
            has_answer = isinstance(rec, dict) and "response" in rec
            answered += has_answer
            if self.exam:
                mark = "•" if has_answer else "·"
            else:
                points += judge(v.q, rec)[1]
                mark = "·" if not has_answer else "✓" if v.q.is_correct(rec["response"]) else "✗"
            b.description = f"{mark} {i + 1}. {plain(v.q.text[lang])}"
            b.tooltip = plain(v.q.text[lang])
            b.button_style = "info" if i == self.k else ""
        score = (t(lang, "answered_count", c=answered, n=len(self.views)) if self.exam
                 else t(lang, "score", c=f"{points:g}", n=len(self.views)))
        self.score_label.value = f"&nbsp;{score}"
