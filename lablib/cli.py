"""The ``lablib`` command: ``lablib doctor`` (later: quiz, release, grade)."""
from __future__ import annotations

import argparse


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
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import doctor as run_doctor

        return run_doctor(args.ranks)
    return 2
