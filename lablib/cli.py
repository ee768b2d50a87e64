"""The ``lablib`` command: ``lablib doctor`` (later: quiz, release, grade)."""
from __future__ import annotations

import argparse
import sys

from .paths import LABS, SOURCES


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
    rel = sub.add_parser("release", help="write learner notebooks from the solved sources")
    rel.add_argument("source_dir", nargs="?", default=str(SOURCES), help="folder of source notebooks (default: sources/)")
    rel.add_argument("out_dir", nargs="?", default=str(LABS), help="where the learner copies go (default: labs/)")
    rel.add_argument("--check", action="store_true", help="write nothing; exit 1 if a learner copy is out of date")
    tdy = sub.add_parser("tidy", help="strip a source notebook's outputs except the ones nbval compares")
    tdy.add_argument("notebooks", nargs="+", help="notebooks to tidy in place (e.g. sources/*.ipynb)")
    grd = sub.add_parser("grade", help="re-execute learners' notebooks under nbval and write a gradebook")
    grd.add_argument("submissions", help="one folder per learner, holding their notebooks and quiz_answers.json")
    grd.add_argument("--release", default=str(LABS),
                     help="the released notebooks the graded cells are restored from (default: labs/)")
    grd.add_argument("--out", default="gradebook.csv", help="gradebook CSV (reports go to <name>-reports/)")
    grd.add_argument("--source", help="source notebooks: also run their hidden checks")
    grd.add_argument("--cell-timeout", type=float, default=120.0, help="seconds per cell (default 120)")
    args = parser.parse_args(argv)
    if args.command == "release":
        return _release(args)
    if args.command == "grade":
        return _grade(args)
    if args.command == "tidy":
        import nbformat

        from .course.release import tidy

        for path in args.notebooks:
            nbformat.write(tidy(nbformat.read(path, as_version=4)), path)
        print(f"tidied {len(args.notebooks)} notebook(s)")
        return 0
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


def _release(args) -> int:
    from .course.release import ReleaseError, release

    try:
        differ = release(args.source_dir, args.out_dir, check=args.check)
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    if args.check:
        if differ:
            print(f"out of date in {args.out_dir}: {', '.join(differ)}; run: lablib release {args.source_dir} "
                  f"{args.out_dir}", file=sys.stderr)
            return 1
        print(f"ok: the learner notebooks in {args.out_dir} match their sources")
        return 0
    print(f"released {args.source_dir} -> {args.out_dir}")
    return 0


def _grade(args) -> int:
    from .course.grade import grade, reports_dir

    try:
        results = grade(args.submissions, args.release, args.out, args.source, args.cell_timeout)
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"grade: {e}", file=sys.stderr)
        return 2
    for lab in results:
        flag = f"  (tampered: {', '.join(t.split(':')[0] for t in lab.tampered)})" if lab.tampered else ""
        print(f"  {lab.learner:<20} {lab.lab:<24} {lab.points:g}/{lab.max_points:g}{flag}")
    print(f"gradebook: {args.out}; reports: {reports_dir(args.out)}/")
    return 0
