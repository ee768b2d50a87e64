"""The quiz interface's own words, per language. The Malay and Arabic phrases the seed quizzes show
("soalan 1 daripada 8", "سؤال 1 من 8", ...) are taken from them as written."""
from __future__ import annotations

import html
import os
import re

UI = {
    "en": {
        "header": "Quiz related to a guide · level: {level}",
        "levels": {"easy": "easy", "medium": "medium", "hard": "hard"},
        "related": "Related guide: {related}",
        "position": "Question {k} of {n}",
        "preview": "Preview every question ({n} questions)",
        "note": "Answers and explanations appear as you take the quiz.",
        "check": "Check", "next": "Next", "previous": "Previous", "language": "Language",
        "correct": "Correct.", "incorrect": "Not quite.",
        "attempts": "attempts: {n}",
        "score": "Score: {c}/{n} correct at the first attempt",
        "number": "a number",
        "not_a_number": "Enter a number, a fraction or a percentage, e.g. 0.25, 1.5e9, 3/19 or 20%; use a point for decimals.",
        "choose": "Pick an answer first.", "several": "Select all that apply.",
        "answered": "answered", "saved": "Your saved answer.",
        "hint": "Hint:", "show_answer": "Show answer",
        "show_tip": "Shows the answer and why; this question then scores no point.",
        "answer_is": "Answer: {answer}", "revealed": "You asked for the answer, so this question scores no point.",
        "late": "No point for this one: the first attempt was not right.",
        "save": "Save", "saved_now": "Saved. You can change your answer until you hand in.",
        "exam_note": "Exam: your answers are saved, not marked here; your instructor grades them.",
        "answered_count": "Answered: {c}/{n}",
    },
    "ms": {
        "header": "Kuiz berkaitan panduan · {level}",
        "levels": {"easy": "Mudah Tahap", "medium": "Sederhana Tahap", "hard": "Keras Tahap"},
        "related": "Laluan panduan yang berkaitan: {related}",
        "position": "soalan {k} daripada {n}",
        "preview": "Pratonton setiap soalan ({n} soalan)",
        "note": "Jawapan dan penjelasan muncul semasa anda mengambil kuiz.",
        "check": "Semak", "next": "Seterusnya", "previous": "Sebelumnya", "language": "Bahasa",
        "correct": "Betul.", "incorrect": "Belum tepat.",
        "attempts": "cubaan: {n}",
        "score": "Markah: {c}/{n} betul pada cubaan pertama",
        "number": "nombor",
        "not_a_number": "Masukkan nombor, pecahan atau peratusan, contohnya 0.25, 1.5e9, 3/19 atau 20%; gunakan titik untuk perpuluhan.",
        "choose": "Pilih jawapan dahulu.", "several": "Pilih semua yang berkenaan.",
        "answered": "dijawab", "saved": "Jawapan anda yang disimpan.",
        "hint": "Petunjuk:", "show_answer": "Tunjukkan jawapan",
        "show_tip": "Menunjukkan jawapan dan sebabnya; soalan ini kemudian tidak diberi markah.",
        "answer_is": "Jawapan: {answer}", "revealed": "Anda telah meminta jawapan, jadi soalan ini tidak diberi markah.",
        "late": "Tiada markah untuk soalan ini: cubaan pertama tidak betul.",
        "save": "Simpan", "saved_now": "Disimpan. Anda boleh menukar jawapan sehingga anda menghantarnya.",
        "exam_note": "Peperiksaan: jawapan anda disimpan, tidak disemak di sini; pengajar anda yang akan menilainya.",
        "answered_count": "Dijawab: {c}/{n}",
    },
    "ar": {
        "header": "اختبار مرتبط بالدليل · {level}",
        "levels": {"easy": "سهل المستوى", "medium": "متوسط المستوى", "hard": "صعب المستوى"},
        "related": "مسار الدليل ذي الصلة: {related}",
        "position": "سؤال {k} من {n}",
        "preview": "معاينة كل سؤال ({n} أسئلة)",
        "note": "تظهر الإجابات والتفسيرات أثناء إجراء الاختبار.",
        "check": "تحقق", "next": "التالي", "previous": "السابق", "language": "اللغة",
        "correct": "إجابة صحيحة.", "incorrect": "ليست صحيحة بعد.",
        "attempts": "المحاولات: {n}",
        "score": "النتيجة: {c}/{n} صحيحة من المحاولة الأولى",
        "number": "رقم",
        "not_a_number": "أدخل رقمًا أو كسرًا أو نسبة مئوية، مثلًا 0.25 أو 1.5e9 أو 3/19 أو 20%؛ استخدم النقطة للكسور العشرية.",
        "choose": "اختر إجابة أولًا.", "several": "اختر كل ما ينطبق.",
        "answered": "تمت الإجابة", "saved": "إجابتك المحفوظة.",
        "hint": "تلميح:", "show_answer": "أظهر الإجابة",
        "show_tip": "يُظهر الإجابة وسببها؛ وبعدها لا يُحتسب لهذا السؤال أي نقطة.",
        "answer_is": "الإجابة: {answer}", "revealed": "طلبت الإجابة، لذلك لا يُحتسب لهذا السؤال أي نقطة.",
        "late": "لا نقطة لهذا السؤال: المحاولة الأولى لم تكن صحيحة.",
        "save": "احفظ", "saved_now": "تم الحفظ. يمكنك تغيير إجابتك حتى تسلّمها.",
        "exam_note": "امتحان: تُحفظ إجاباتك ولا تُصحَّح هنا؛ يقيّمها المدرّس.",
        "answered_count": "تمت الإجابة: {c}/{n}",
    },
}


def pick_language(available, requested: str | None = None) -> str:
    """``requested``, else ``$LABLIB_LANG``, else English; a language the quiz lacks falls back to English."""
    for lang in (requested, os.environ.get("LABLIB_LANG")):
        if lang:
            if lang not in UI:
                raise ValueError(f"unknown language {lang!r}: use one of {', '.join(UI)}")
            if lang in available:
                return lang
    return "en"


def t(lang: str, key: str, **kw) -> str:
    text = UI[lang][key]
    return text.format(**kw) if kw else text


def rich(text: str) -> str:
    """Escape ``text`` for HTML and render `code` and **bold**, the only markup the banks use."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


def plain(text: str) -> str:
    """For widget labels, which show text as is."""
    return text.replace("`", "").replace("**", "")
