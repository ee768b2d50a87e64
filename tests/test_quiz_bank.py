"""Quiz banks: the seed quizzes exactly as specified, and a clear error for every kind of mistake."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lablib.quiz import arith, bank

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ROOT / "quizzes" / "seeds"
LABS = {"sharding (memory)": "01_sharding", "collectives (all-gather, reduce-scatter)": "02_collectives",
        "prefetch and overlap": "03_prefetch_overlap", "tensor parallelism": "04_tensor_parallel",
        "pipeline bubbles": "05_pipeline_bubbles"}


@pytest.fixture(scope="module")
def banks():
    return bank.load_all(ROOT / "quizzes")


def _english_seeds():
    """{quiz number: [(question, [choices], correct index)]} and {(quiz, question): lab} from quizzes-en.md."""
    quizzes, labs, current = {}, {}, None
    for line in (SEEDS / "quizzes-en.md").read_text().splitlines():
        if m := re.match(r"## Quiz (\d)", line):
            current = quizzes.setdefault(int(m.group(1)), [])
        elif current is not None and (m := re.match(r"\d+\. (.*)", line)):
            current.append([m.group(1), [], None])
        elif current is not None and (m := re.match(r"\s+- (.*)", line)):
            text = m.group(1)
            if text.endswith("**(correct)**"):
                current[-1][2] = len(current[-1][1])
                text = text[: -len("**(correct)**")].strip()
            current[-1][1].append(text)
        elif m := re.match(r"\| (FSDP|Model/pipeline) ([\d, ]+) \| (.*) \|", line):
            for n in m.group(2).split(","):
                labs[(1 if m.group(1) == "FSDP" else 2, n.strip())] = LABS[m.group(3)]
    return quizzes, labs


@pytest.mark.parametrize("number, quiz_id", [(1, "fsdp"), (2, "model-pipeline")])
def test_seed_quizzes_are_keyed_and_placed_as_specified(banks, number, quiz_id):
    seeds, labs = _english_seeds()
    quiz = banks[quiz_id]
    assert quiz.level == "hard"
    assert [q.id for q in quiz.questions] == [str(i) for i in range(1, 9)]
    for q, (text, choices, correct) in zip(quiz.questions, seeds[number]):
        assert q.text["en"] == text
        assert [c["en"] for c in q.choices] == choices
        assert q.type == "single" and q.answer == {correct}, q.ref
        assert q.lab == labs[(number, q.id)], q.ref
        assert all(len(q.explanation[lang]) > 80 for lang in quiz.languages), q.ref


def test_malay_seed_text_is_kept_verbatim(banks):
    lines = (SEEDS / "fsdp-quiz.ms.txt").read_text().splitlines()
    questions = []
    for line in lines:
        if m := re.match(r"\s+\d+\. (.*)", line):
            questions.append([m.group(1).strip(), []])
        elif m := re.match(r"\s+• (.*)", line):
            questions[-1][1].append(m.group(1).strip())
    quiz = banks["fsdp"]
    assert quiz.title["ms"] == lines[2].strip() and quiz.description["ms"] == lines[4].strip()
    for q, (text, choices) in zip(quiz.questions[:6], questions[:6]):  # 7-8 were in English
        assert q.text["ms"] == text and [c["ms"] for c in q.choices] == choices, q.ref
    for q in quiz.questions[6:]:
        assert q.text["ms"] != q.text["en"]  # translated, so the quiz is whole in Malay


def test_arabic_seed_text_is_kept_verbatim(banks):
    lines = (SEEDS / "model-pipeline-parallel-quiz.ar.txt").read_text().splitlines()
    items = [line[2:].strip() for line in lines if line.startswith("- ")]
    groups = [items[i:i + 5] for i in range(0, 40, 5)]
    quiz = banks["model-pipeline"]
    assert quiz.title["ar"] == lines[1].strip() and quiz.description["ar"] == lines[2].strip()
    for q, group in zip(quiz.questions[:6], groups[:6]):
        assert [q.text["ar"]] + [c["ar"] for c in q.choices] == group, q.ref
    for q in quiz.questions[6:]:
        assert re.search(r"[\u0600-\u06FF]", q.text["ar"])  # translated into Arabic


def test_every_bank_is_valid_and_numeric_questions_exist(banks):
    assert {"fsdp", "model-pipeline", "welcome"} <= set(banks)
    welcome = banks["welcome"]
    assert len(welcome.questions) >= 5
    assert any(q.type == "numeric" for q in welcome.questions)


GOOD = """\
id: {id}
level: easy
lab: 00_welcome
languages: [en, ms]
title: {{en: T, ms: T}}
description: {{en: D, ms: D}}
questions:
  - id: q1
    tags: [x]
    text: {{en: Which one, ms: Yang mana}}
    choices:
      - {{en: A, ms: A}}
      - {{en: B, ms: B}}
    answer: a
    explanation: {{en: Because., ms: Kerana.}}
    hint: {{en: Think., ms: Fikir.}}
  - id: n1
    type: numeric
    tags: [x]
    given: {{a: 1, b: 2}}
    key: a + b
    text: {{en: How many, ms: Berapa}}
    answer: 3
    tolerance: 0.5
    explanation: {{en: Three., ms: Tiga.}}
    hint: {{en: Count them., ms: Kira.}}
"""


def _write(tmp_path, text, name="broken"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_good_fixture_loads(tmp_path):
    quiz = bank.load(_write(tmp_path, GOOD.format(id="good"), "good"))
    q1, n1 = quiz.questions
    assert q1.is_correct([0]) and not q1.is_correct([1]) and not q1.is_correct(None)
    assert n1.is_correct(3.4) and not n1.is_correct(3.6) and not n1.is_correct("x")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace("level: easy\n", ""), r"field 'level': missing"),
    (lambda s: s.replace("    answer: a\n", ""), r"question q1: field 'answer' missing"),
    (lambda s: s.replace("    answer: a\n", "    answer: []\n"), r"question q1: field 'answer': no correct choice given"),
    (lambda s: s.replace("    answer: a\n", "    answer: [a, b]\n"),
     r"question q1: field 'answer': a single-choice question needs exactly one correct choice, got a, b"),
    (lambda s: s.replace("    answer: a\n", "    answer: e\n"), r"question q1: field 'answer': 'e' is not a choice letter \(a-b\)"),
    (lambda s: s.replace("  - id: n1\n", "  - id: q1\n"), r"question q1: duplicate question id"),
    (lambda s: s.replace("      - {en: B, ms: B}\n", ""), r"question q1: field 'choices': needs at least 2 choices, got 1"),
    (lambda s: s.replace("[en, ms]", "[en, ms, fr]"), r"field 'languages': unknown language 'fr'"),
    (lambda s: s.replace("{en: Which one, ms: Yang mana}", "{en: Which one}"), r"question q1: field 'text': missing language 'ms'"),
    (lambda s: s.replace("{en: Because., ms: Kerana.}", "{en: Because., ms: Kerana., ar: x}"),
     r"question q1: field 'explanation': unknown language 'ar' \(this quiz has en, ms\)"),
    (lambda s: s.replace("    tolerance: 0.5\n", ""), r"question n1: field 'tolerance' missing: a numeric answer needs one"),
    (lambda s: s.replace("    answer: 3\n", "    answer: three\n"), r"question n1: field 'answer': a numeric question needs a number"),
    (lambda s: s.replace("id: broken", "id: other"), r"field 'id': 'other' must match the file name"),
    (lambda s: s + "  - oops\n", r"question #3: expected a mapping"),
    (lambda s: s.replace("title: {en: T, ms: T}", "title: [T]"), r"field 'title': expected text or a map"),
    (lambda s: s.replace("level: easy", "level: [easy"), r"not valid YAML"),
    (lambda s: s.replace("    hint: {en: Think., ms: Fikir.}\n", ""),
     r"question q1: field 'hint' missing: every question needs a hint, in every language of its quiz"),
    (lambda s: s.replace("{en: Think., ms: Fikir.}", "{en: Think.}"), r"question q1: field 'hint': missing language 'ms'"),
    (lambda s: s.replace("{en: Count them., ms: Kira.}", "{en: Count them., ms: Jawapannya 3 sahaja.}"),
     r"question n1: field 'hint': the ms hint states the answer \(3\); point at the idea"),
    (lambda s: s.replace("level: easy", "level: easy\nmode: quiz"), r"field 'mode': 'quiz' is not one of practice, exam"),
    (lambda s: s.replace("{en: Think., ms: Fikir.}", "{en: Think., ms: Bukan (b).}"),
     r"question q1: field 'hint': the ms text names a choice by its letter, \(b\); learners see the choices in "
     r"another order, with other letters: name it by what it says"),
])
def test_each_mistake_is_named_with_file_question_and_field(tmp_path, edit, message):
    path = _write(tmp_path, edit(GOOD.format(id="broken")))
    with pytest.raises(bank.QuizError) as info:
        bank.load(path)
    text = str(info.value)
    assert str(path) in text
    assert re.search(message, text), text


def test_all_problems_are_reported_at_once(tmp_path):
    path = _write(tmp_path, GOOD.format(id="broken").replace("    answer: a\n", "").replace("    tolerance: 0.5\n", ""))
    with pytest.raises(bank.QuizError) as info:
        bank.load(path)
    assert len(info.value.problems) == 2


def test_quiz_ids_are_unique_because_they_match_file_names(tmp_path):
    _write(tmp_path, GOOD.format(id="a"), "a")
    path = _write(tmp_path, GOOD.format(id="a"), "b")  # a copy of a.yaml, id unchanged
    with pytest.raises(bank.QuizError, match=r"field 'id': 'a' must match the file name"):
        bank.load(path)


def test_unquoted_colon_gets_a_hint(tmp_path):
    text = GOOD.format(id="broken").replace("[en, ms]", "[en]").replace("      - {en: B, ms: B}", "      - B: it is b")
    with pytest.raises(bank.QuizError, match="quote a text that contains ': '"):
        bank.load(_write(tmp_path, text))


def test_explanations_may_hold_parentheses_that_are_not_choice_letters(tmp_path):
    text = GOOD.format(id="good").replace("{en: Because., ms: Kerana.}", "{en: f(a) and (x) and (c) and (1)., ms: K.}")
    assert bank.load(_write(tmp_path, text, "good")).questions[0].explanation["en"].startswith("f(a)")  # 2 choices: no (c)


def test_numeric_hints_may_hold_other_numbers(tmp_path):
    text = GOOD.format(id="good").replace("{en: Count them., ms: Kira.}", "{en: Add 1.5 and 1.5 or 30., ms: Kira.}")
    assert bank.load(_write(tmp_path, text, "good")).questions[1].hint["en"] == "Add 1.5 and 1.5 or 30."


def _keyless(text):
    text = text.replace("level: easy", "mode: exam\nlevel: easy")
    for line in ("    answer: a\n", "    answer: 3\n", "    key: a + b\n", "    tolerance: 0.5\n", "    explanation: {en: Because., ms: Kerana.}\n",
                 "    explanation: {en: Three., ms: Tiga.}\n", "    hint: {en: Think., ms: Fikir.}\n",
                 "    hint: {en: Count them., ms: Kira.}\n"):
        text = text.replace(line, "")
    return text


def test_an_exam_bank_loads_without_keys_and_cannot_judge(tmp_path):
    quiz = bank.load(_write(tmp_path, _keyless(GOOD.format(id="exam")), "exam"))
    assert quiz.mode == "exam" and not quiz.keyed
    q1, n1 = quiz.questions
    assert not q1.keyed and q1.answer is None and q1.explanation == {} and q1.hint == {}
    assert [c["en"] for c in q1.choices] == ["A", "B"] and n1.type == "numeric"
    with pytest.raises(bank.QuizError, match=r"exam/q1: this bank is an exam copy .* saved but not judged"):
        q1.is_correct([0])


def test_an_exam_bank_must_not_carry_a_key(tmp_path):
    text = _keyless(GOOD.format(id="exam")).replace("    tags: [x]\n    text: {en: Which", "    tags: [x]\n    answer: a\n"
                                                                                            "    text: {en: Which")
    with pytest.raises(bank.QuizError, match=r"question q1: field 'answer': an exam bank \(mode: exam\) carries no "
                                             r"answer key, explanation or hint; remove it"):
        bank.load(_write(tmp_path, text, "exam"))


def test_quiz_check_command(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "lablib", "quiz", "check"], capture_output=True, text=True)
    assert ok.returncode == 0 and re.search(r"ok: \d+ quiz bank\(s\)", ok.stdout), ok.stderr
    _write(tmp_path, GOOD.format(id="broken").replace("    tolerance: 0.5\n", ""))
    bad = subprocess.run([sys.executable, "-m", "lablib", "quiz", "check", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "broken.yaml: question n1: field 'tolerance' missing" in bad.stderr


def test_quiz_check_names_a_missing_hint_and_accepts_an_exam_bank(tmp_path):
    _write(tmp_path, GOOD.format(id="broken").replace("{en: Count them., ms: Kira.}", "{en: Count them.}"))
    bad = subprocess.run([sys.executable, "-m", "lablib", "quiz", "check", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "broken.yaml: question n1: field 'hint': missing language 'ms'" in bad.stderr
    exam = tmp_path / "exam"
    exam.mkdir()
    _write(exam, _keyless(GOOD.format(id="keyless")), "keyless")
    ok = subprocess.run([sys.executable, "-m", "lablib", "quiz", "check", str(exam)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "keyless.yaml: 2 questions (numeric, single) in en, ms; exam copy, no answer key" in ok.stdout


def test_every_numeric_key_is_its_own_arithmetic(banks):
    """Each numeric question of every bank keeps its key as an expression of its inputs, and the typed
    answer is that expression's value at the answer's decimals (the bank refuses to load otherwise)."""
    import yaml

    numeric = 0
    for path in sorted((ROOT / "quizzes").glob("*.yaml")):
        for raw in yaml.safe_load(path.read_text(encoding="utf-8"))["questions"]:
            if raw.get("type") != "numeric":
                continue
            numeric += 1
            value = arith.evaluate(raw["key"], raw["given"])
            assert round(value, arith.decimals(raw["answer"])) == pytest.approx(raw["answer"]), (path.name, raw["id"])
            question = next(q for q in banks[path.stem].questions if q.id == raw["id"])
            assert question.is_correct(value), (path.name, raw["id"])  # the exact value is inside the tolerance
            assert "{" not in question.explanation["en"] + question.text["en"], (path.name, raw["id"])
    assert numeric >= 30


def test_the_dispatch_bytes_key_is_what_its_explanation_computes(banks):
    q = next(q for q in banks["experts"].questions if q.id == "dispatch-bytes")
    assert q.answer == pytest.approx(4096 * 2 * 4096 * 2 * 7 / 8 / 1e6, abs=0.005)  # 58.72 MB
    assert q.is_correct(58.72) and not q.is_correct(117.44)  # the old key, twice the bytes
    assert "= 67.1 MB" in q.explanation["en"] and "58.72 MB" in q.explanation["en"]


def test_tp_ratio_explanation_quotes_lab04s_cost_model(banks):
    """The explanation of tensor/tp-ratio quotes lab 04's chart, which a bank cannot compute: held here."""
    from lablib.views.tensor_parallel import per_layer

    ratio = {n: per_layer(8192, n, "InfiniBand")["comm"] / per_layer(8192, n, "InfiniBand")["compute"] for n in (4, 16)}
    text = next(q for q in banks["tensor"].questions if q.id == "tp-ratio").explanation["en"]
    assert (f"about {ratio[4]:.2f} at TP 4, about {ratio[16]:.2f} at TP 16, {ratio[16] / ratio[4]:.1f} times"
            in text), text


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace("    answer: 3\n", "    answer: 4\n").replace("tolerance: 0.5", "tolerance: 1"),
     r"question n1: field 'answer': 4, but the key a \+ b is 3 \(3 at the answer's 0 decimals\): correct the "
     r"answer, the key or its inputs"),
    (lambda s: s.replace("    key: a + b\n", ""), r"question n1: field 'key' missing: a numeric answer is computed"),
    (lambda s: s.replace("key: a + b", "key: a + c"), r"question n1: field 'key': 'a \+ c': unknown name 'c' \(the inputs in "
                                                      r"'given': a, b\)"),
    (lambda s: s.replace("key: a + b", "key: __import__('os')"), r"question n1: field 'key': .* is not allowed"),
    (lambda s: s.replace("    given: {a: 1, b: 2}\n", ""), r"question n1: field 'key': an expression needs its inputs"),
    (lambda s: s.replace("given: {a: 1, b: 2}", "given: {a: one, b: 2}"), r"question n1: field 'given': must map names"),
    (lambda s: s.replace("{en: Three., ms: Tiga.}", "{en: 'Three: {a + d}.', ms: Tiga.}"),
     r"question n1: field 'explanation': a figure cannot be computed: 'a \+ d': unknown name 'd'"),
    (lambda s: s.replace("{en: How many, ms: Berapa}", "{en: 'How many {a', ms: Berapa}"),
     r"question n1: field 'text': a figure cannot be computed: a lone"),
    (lambda s: s.replace("{en: Count them., ms: Kira.}", "{en: 'Count {a}+{b}={a + b}.', ms: Kira.}"),
     r"question n1: field 'hint': the en hint states the answer \(3\)"),
])
def test_a_key_that_disagrees_with_its_arithmetic_is_named(tmp_path, edit, message):
    path = _write(tmp_path, edit(GOOD.format(id="broken")))
    with pytest.raises(bank.QuizError) as info:
        bank.load(path)
    assert re.search(message, str(info.value)), str(info.value)


def test_texts_compute_their_figures_from_the_inputs(tmp_path):
    text = (GOOD.format(id="good").replace("{en: How many, ms: Berapa}", "{en: 'How many is {a} + {b:.1f}?', ms: Berapa}")
            .replace("{en: Three., ms: Tiga.}", "{en: 'It is {key}, {{not}} {a * 1000:,}.', ms: 'Tiga {key:g}.'}"))
    n1 = bank.load(_write(tmp_path, text, "good")).questions[1]
    assert n1.text["en"] == "How many is 1 + 2.0?" and n1.answer == 3
    assert n1.explanation == {"en": "It is 3, {not} 1,000.", "ms": "Tiga 3."}


def test_an_exam_copy_keeps_the_inputs_and_drops_the_key(tmp_path):
    text = GOOD.format(id="exam").replace("{en: How many, ms: Berapa}", "{en: 'How many is {a} + {b}?', ms: Berapa}")
    n1 = bank.load(_write(tmp_path, _keyless(text), "exam")).questions[1]
    assert n1.text["en"] == "How many is 1 + 2?" and not n1.keyed
    with pytest.raises(bank.QuizError, match=r"question n1: field 'key': an exam bank \(mode: exam\) carries no answer"):
        bank.load(_write(tmp_path, _keyless(text).replace("    given:", "    key: a + b\n    given:"), "exam"))


def test_every_hint_keeps_the_answer_to_itself(banks):
    for quiz in banks.values():
        for q in quiz.questions:
            for lang in quiz.languages:
                assert q.hint[lang] != q.explanation[lang], (q.ref, lang)
                if q.type != "numeric":  # (numeric hints are checked by the bank itself)
                    for i in q.answer:
                        assert q.choices[i][lang].lower() not in q.hint[lang].lower(), (q.ref, lang)
