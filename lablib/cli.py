"""The ``lablib`` command: doctor, quiz check, release, tidy, grade."""
from __future__ import annotations

import argparse
import sys

from .course.limits import CHECK_TIMEOUT, TIME_LIMIT
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
    qcheck = quiz_sub.add_parser("check", help="validate every quiz bank (a hint in every language included); "
                                               "exit 1 on any problem")
    qcheck.add_argument("folder", nargs="?",
                        help="folder of *.yaml banks (default: $LABLIB_QUIZZES, else the repository's quizzes/)")
    rel = sub.add_parser(
        "release", help="write learner notebooks from the solved sources",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write the learner copy of every source notebook: solutions become stubs; hidden checks,\n"
                    "source-only cells, outputs and NBVAL_CHECK_OUTPUT markers are removed.",
        epilog="quiz modes:\n"
               "  practice  the learners' banks keep their answer keys: a wrong answer shows a hint, a right one\n"
               "            the explanation, and a question scores when right at the first attempt\n"
               "  exam      keyless copies of the banks (no answers, explanations or hints; mode: exam) go to\n"
               "            --banks-out, by default the folder 'quizzes' beside OUT_DIR. Publish them as the\n"
               "            learner copy's quizzes/ (lablib reads $LABLIB_QUIZZES, else the quizzes/ folder of\n"
               "            its repository): the widgets then only save answers, and `lablib grade` judges them\n"
               "            with your keyed banks. Example: lablib release --quiz exam sources exam/labs\n"
               "            writes exam/labs/*.ipynb and exam/quizzes/*.yaml. Never the keyed banks' folder.")
    rel.add_argument("source_dir", nargs="?", default=str(SOURCES), help="folder of source notebooks (default: sources/)")
    rel.add_argument("out_dir", nargs="?", default=str(LABS), help="where the learner copies go (default: labs/)")
    rel.add_argument("--check", action="store_true", help="write nothing; exit 1 if a learner copy is out of date")
    rel.add_argument("--quiz", choices=("practice", "exam"), default="practice",
                     help="practice (default) or exam: see below")
    rel.add_argument("--banks-out", metavar="DIR",
                     help="exam mode: where the keyless banks go (default: OUT_DIR/../quizzes)")
    tdy = sub.add_parser("tidy", help="strip a source notebook's outputs except the ones nbval compares")
    tdy.add_argument("notebooks", nargs="+", help="notebooks to tidy in place (e.g. sources/*.ipynb)")
    grd = sub.add_parser("grade", help="check learners' exercise code in a sandbox, score their quizzes, write a "
                                       "gradebook", description="Each learner's exercise functions run in a box "
                         "(bubblewrap) and the data they produce is judged outside it; the quiz answers are scored "
                         "with the instructor's banks. See docs/instructors.md.")
    grd.add_argument("submissions", nargs="?",
                     help="one folder per learner, holding their notebooks and quiz_answers.json")
    grd.add_argument("--release", default=str(LABS),
                     help="the released notebooks whose check cells say what is checked (default: labs/)")
    grd.add_argument("--out", default="gradebook.csv", help="gradebook CSV (reports go to <name>-reports/)")
    grd.add_argument("--source", help="source notebooks: also run their hidden checks and flag copied solutions")
    grd.add_argument("--banks", help="the keyed quiz banks (default: the repository's quizzes/)")
    grd.add_argument("--secret", help="32 hex digits (128 bits) the checks' inputs are drawn from (default: drawn "
                                      "at random and printed, to grade again on the same inputs; reports show "
                                      "only its fingerprint)")
    grd.add_argument("--check-timeout", type=float, default=CHECK_TIMEOUT,
                     help=f"seconds for one check (default {CHECK_TIMEOUT:g})")
    grd.add_argument("--time-limit", type=float, default=TIME_LIMIT,
                     help=f"seconds for one learner's box: their labs, or a lab that builds on earlier labs' answers "
                          f"(default {TIME_LIMIT:g})")
    grd.add_argument("--jobs", type=int, default=1, help="learners graded at once, each in its own box (default 1; "
                                                         "2 or more overlaps what a learner's checks wait for)")
    grd.add_argument("--shard", metavar="K/N", help="grade every N-th learner from the K-th only (an array job "
                                                    "spreads a class over machines; --merge joins the gradebooks)")
    grd.add_argument("--only", metavar="LEARNER", help="grade this learner folder alone; its rows replace theirs "
                                                       "in the --out gradebook, every other row is kept")
    grd.add_argument("--merge", nargs="+", metavar="CSV", help="grade nothing: join these gradebooks (the shards') "
                                                               "into --out, their reports into its reports folder")
    grd.add_argument("--lms", choices=("canvas", "moodle"), help="also write <out>-canvas.csv or <out>-moodle.csv, "
                                                                 "for the LMS's gradebook import (needs --roster)")
    grd.add_argument("--roster", help="CSV: a column 'learner' (each submission folder's name) and the LMS's "
                                      "identity columns (Canvas: Student, ID, SIS User ID, SIS Login ID, Section; "
                                      "Moodle: Email address, ID number or Username)")
    grd.add_argument("--junit", metavar="FILE", help="also write the results as JUnit XML, a test case per check "
                                                     "and quiz question")
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
        exam = "" if b.keyed else "; exam copy, no answer key"
        print(f"  {b.path.name}: {len(b.questions)} questions ({', '.join(kinds)}) in {', '.join(b.languages)}{exam}")
    print(f"ok: {len(banks)} quiz bank(s), {sum(len(b.questions) for b in banks.values())} questions")
    return 0


def _release(args) -> int:
    from .course.release import ReleaseError, release

    if args.banks_out and args.quiz != "exam":
        print("release: --banks-out is for --quiz exam (a practice release uses the banks as they are)",
              file=sys.stderr)
        return 2
    try:
        differ = release(args.source_dir, args.out_dir, check=args.check, quiz=args.quiz, banks_out=args.banks_out)
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    exam = " --quiz exam" + (f" --banks-out {args.banks_out}" if args.banks_out else "") if args.quiz == "exam" else ""
    if args.check:
        if differ:
            print(f"out of date: {', '.join(differ)}; run: lablib release{exam} {args.source_dir} {args.out_dir}",
                  file=sys.stderr)
            return 1
        print(f"ok: the learner notebooks in {args.out_dir} match their sources")
        return 0
    print(f"released {args.source_dir} -> {args.out_dir}")
    if args.quiz == "exam":
        from pathlib import Path

        banks_out = args.banks_out or Path(args.out_dir).parent / "quizzes"
        print(f"keyless exam banks -> {banks_out} (the learner copy's quizzes/, or set LABLIB_QUIZZES to it)")
    return 0


def _grade(args) -> int:
    from pathlib import Path

    from .course.gradebook import GradebookError, merge_files, read_roster, read_rows, reports_dir, write_junit, write_lms

    out = Path(args.out)
    try:
        if (args.lms is None) != (args.roster is None):
            raise GradebookError("--lms and --roster go together: the LMS file takes each learner's identity "
                                 "from the roster")
        if (args.merge is None) == (args.submissions is None):
            raise GradebookError("give the folder of submissions to grade, or --merge with the gradebooks to join")
        roster = read_roster(Path(args.roster), args.lms) if args.lms else None
        if roster is not None and args.submissions and Path(args.submissions).is_dir():  # before hours of grading
            from .course.grade import learner_folders

            missing = [p.name for p in learner_folders(args.submissions)
                       if p.name not in roster and (args.only is None or p.name == args.only)]
            if missing:
                raise GradebookError(f"{args.roster} has no row for {', '.join(missing)}: add each learner's identity")
        if args.merge:
            merge_files([Path(p) for p in args.merge], out)
            print(f"merged {len(args.merge)} gradebook(s)")
        else:
            _grade_submissions(args, out)
        table = read_rows(out)
        if roster is not None:
            lms_out = out.with_name(f"{out.stem}-{args.lms}.csv")
            write_lms(table, lms_out, args.lms, roster)
            print(f"{args.lms} gradebook import: {lms_out}")
        if args.junit:
            write_junit(table, Path(args.junit))
            print(f"JUnit XML: {args.junit}")
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"grade: {e}", file=sys.stderr)
        return 2
    print(f"gradebook: {out}; reports: {reports_dir(out)}/")
    return 0


def _grade_submissions(args, out):
    from .course.grade import grade, parse_secret

    shard = (1, 1)
    if args.shard:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit()):
            raise ValueError(f"--shard {args.shard}: write it K/N, e.g. --shard 2/4 for the second of four")
        shard = (int(k), int(n))
    secret = parse_secret(args.secret)  # a bad one is refused before any learner is graded
    results = grade(args.submissions, args.release, out, args.source, args.check_timeout, args.time_limit,
                    secret, args.banks, args.jobs, shard, args.only)
    if args.secret is None:
        print(f"the checks' inputs were drawn from the secret {secret.hex()} (--secret {secret.hex()} grades on the "
              "same inputs again; keep it from learners)")
    for lab in results:
        flag = f"  (flagged: {'; '.join(lab.flags)})" if lab.flags else ""
        invalid = next((f"  ({n})" for n in lab.notes if n.startswith("invalid")), "")
        print(f"  {lab.learner:<20} {lab.lab:<24} {lab.points:g}/{lab.max_points:g}{invalid}{flag}")
