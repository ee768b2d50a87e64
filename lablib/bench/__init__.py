"""Every performance claim of the course, measured side by side in one run, as one table.

    python -m lablib.bench [--quick] [--json FILE] [--only P1,P3] [--readme]      (or ./lab.sh bench ...)

Per claim: the course's number and its anchor's, measured in the same run, their ratio, median and
min-max over repetitions, and the target. ``--quick`` (about a minute on 2 cores) leaves out the
whole-course runs (P2, P8); the full run takes about 10 minutes. With a GPU per rank it measures NCCL.

The items live by what they measure: pool.py (P1, P7, P13, F), labs.py (P3-P6, P9-P12, P14), course.py (P2, P8);
table.py prints and writes the table, rows.py holds what they share.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .course import p2_course, p8_grading
from .labs import p3_collectives, p4_fsdp, p5_hidden, p6_pipeline, p9_tensor, p10_context, p11_experts, p12_composition, \
    p14_precision
from .pool import failures, p1_pool, p7_tracing, p13_strict
from .rows import Row, Settings
from .table import README_END, README_START, machine, table, write_readme

__all__ = ["ITEMS", "README_END", "README_START", "Row", "Settings", "machine", "main", "run", "table", "write_readme"]

ITEMS = {"P1": p1_pool, "P2": p2_course, "P3": p3_collectives, "P4": p4_fsdp, "P5": p5_hidden, "P6": p6_pipeline,
         "P7": p7_tracing,
         "P8": p8_grading, "P9": p9_tensor, "P10": p10_context, "P11": p11_experts,
         "P12": p12_composition, "P13": p13_strict, "P14": p14_precision, "F": failures}
WHOLE_COURSE = ("P2", "P8")


def _progress(done: int, total: int, what: str):
    print(f"\r[{'#' * done}{'-' * (total - done)}] {done}/{total} {what:<60}", end="" if done < total else "\n",
          file=sys.stderr, flush=True)


def run(only=None, quick=False, reps=None, backend="auto") -> dict:
    s = Settings(quick, reps or (2 if quick else 5), backend)
    chosen = [k for k in ITEMS if (only is None or k in only) and not (quick and k in WHOLE_COURSE)]
    rows: list[Row] = []
    course = None
    for i, key in enumerate(chosen):
        _progress(i, len(chosen), f"{key}: {ITEMS[key].__name__}")
        got = ITEMS[key](s, course) if key == "P8" else ITEMS[key](s)
        if key == "P2":
            course = got[0].ours
        rows += got
    _progress(len(chosen), len(chosen), "done")
    for key in ITEMS:
        if key not in chosen:
            why = "left out by --quick (a whole-course run)" if quick and key in WHOLE_COURSE else "not run (--only)"
            rows.append(Row(key, ITEMS[key].__name__, "", note=why))
    order = ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9", "P10", "P11", "P12", "P13", "P14", "F"]
    rows.sort(key=lambda r: order.index(r.item))
    return {"machine": machine(backend), "quick": quick, "reps": s.reps, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lablib.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="under 3 minutes: no whole-course runs, fewer repetitions")
    ap.add_argument("--only", help=f"comma-separated items among {', '.join(ITEMS)}")
    ap.add_argument("--reps", type=int, help="repetitions per measure (default 5, 2 with --quick)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--readme", action="store_true", help="write the table into docs/performance.md")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    args = ap.parse_args(argv)
    only = None
    if args.only:
        only = [k.strip() for k in args.only.split(",")]
        unknown = [k for k in only if k not in ITEMS]
        if unknown:
            ap.error(f"unknown item(s) {', '.join(unknown)}: choose from {', '.join(ITEMS)}")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    result = run(only, args.quick, args.reps, args.backend)
    text = table(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "rows": [asdict(r) | {"ratio": r.ratio}
                                                                   for r in result["rows"]]}, indent=1))
    if args.readme:
        write_readme(text)
    return 0
