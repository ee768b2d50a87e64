"""The ``lablib`` command: ``lablib doctor`` (later: quiz, release, grade)."""
from __future__ import annotations

import argparse
import sys


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of ranks >= 1, got {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lablib", description="Tools for the distributed-training labs.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the installation and run a 2-rank all-reduce")
    doctor.add_argument("--ranks", type=_positive_int, default=2, help="ranks for the smoke test (default 2)")
    quiz = sub.add_parser("quiz", help="quiz banks")
    quiz_sub = quiz.add_subparsers(dest="quiz_command", required=True)
    qcheck = quiz_sub.add_parser("check", help="validate every quiz bank; exit 1 on any problem")
    qcheck.add_argument("folder", nargs="?", help="folder of *.yaml banks (default: the repository's quizzes/)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import doctor as run_doctor

        return run_doctor(args.ranks)
    if args.command == "quiz":
        return _quiz_check(args.folder)
    return 2


def _quiz_check(folder) -> int:
    from .quiz.bank import QuizError, default_dir, load_all

    folder = folder or default_dir()
    try:
        banks = load_all(folder)
    except QuizError as e:
        print(f"{len(e.problems)} problem(s) in the quiz banks:", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    for b in banks.values():
        kinds = sorted({q.type for q in b.questions})
        print(f"  {b.path.name}: {len(b.questions)} questions ({', '.join(kinds)}) in {', '.join(b.languages)}")
    print(f"ok: {len(banks)} quiz bank(s), {sum(len(b.questions) for b in banks.values())} questions")
    return 0
