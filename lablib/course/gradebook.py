"""What ``lablib grade`` writes: the gradebook (one CSV row per check and quiz question, and a total per
learner and lab), a report per learner, and what instructors take from the gradebook elsewhere: an LMS's
gradebook import (Canvas, Moodle), JUnit XML for classrooms that grade in CI, and one gradebook joined
from the shards of a class graded on several machines.

Everything here is written from the rows, so a gradebook merged from shards gives the same files as one
graded in one run. Learners' text (error messages, answers, folder names) is written escaped: lone
surrogates and control characters as ``\\uXXXX``, and a report's code block fenced longer than any run
of backticks inside it, so nothing a learner wrote can end the block or break the file.
"""
from __future__ import annotations

import csv
import io
import os
import re
import shutil
import socket
import tempfile
import time
import unicodedata
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

COLUMNS = ["learner", "lab", "item", "kind", "points", "max_points", "status", "flags", "detail"]
# The identity columns of each LMS's gradebook import, in its order, then a column per lab and a total.
# Canvas (Grades > Import) matches a learner by ID, then SIS User ID / SIS Login ID, then name, and needs
# the headers Student and Section; a column without "(id)" becomes a new assignment, with the points of
# the "Points Possible" row. Moodle (Grades > Import > CSV file) maps one identifier column ("Map from")
# to email address, ID number or username, and each other column to a grade item or a new one.
LMS = {"canvas": ("Student", "ID", "SIS User ID", "SIS Login ID", "Section"),
       "moodle": ("Email address", "ID number", "Username")}
TOTAL = "Total"


@dataclass
class Item:
    learner: str
    lab: str
    item: str
    kind: str            # "check" or "quiz"
    points: float
    max_points: float
    status: str          # passed / failed / refused / not run / invalid / missing notebook / the quiz's statuses
    detail: str = ""


@dataclass
class LabResult:
    learner: str
    lab: str
    items: list[Item] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)   # for the instructor: code that matches a solution
    feedback: str = ""

    @property
    def points(self) -> float:
        return sum(i.points for i in self.items)

    @property
    def max_points(self) -> float:
        return sum(i.max_points for i in self.items)


class GradebookError(ValueError):
    """A gradebook, shard or roster that cannot be used; the message says why and what to do."""


# -- text a learner wrote --------------------------------------------------------------------------------
def _escape(ch: str) -> str:
    if ch in "\n\t":
        return ch
    if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Cn", "Zl", "Zp"):  # Cn: U+FFFF and the like, not XML
        return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"
    return ch


_UNSAFE = re.compile(r"[^\n\t\x20-\x7e\xa0-\u00ac\u00ae-\u05ff]")  # the characters worth a closer look


def clean(text) -> str:
    """``text`` with lone surrogates, control and format characters (escape sequences, bidi overrides), line
    separators and non-characters written as ``\\uXXXX``: safe in UTF-8, CSV, XML and Markdown."""
    return _UNSAFE.sub(lambda m: _escape(m.group()), str(text))


def fenced(text: str, indent: str = "") -> list[str]:
    """A Markdown code block holding ``text``: its fence is longer than any run of backticks in it."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    return [indent + fence, *[indent + line for line in clean(text).splitlines()], indent + fence]


def write_atomic(path: Path, text: str):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- the rows --------------------------------------------------------------------------------------------
def rows(results: list[LabResult]) -> list[dict]:
    """The gradebook's rows for ``results``: one per item, then the lab's TOTAL (its status the note that
    made the lab invalid, its flags every flag)."""
    out = []
    for lab in results:
        for it in lab.items:
            out.append(dict(zip(COLUMNS, [it.learner, it.lab, it.item, it.kind, f"{it.points:g}",
                                          f"{it.max_points:g}", it.status,
                                          "; ".join(f for f in lab.flags if f.startswith(f"{it.item}:")),
                                          it.detail if it.status != "passed" else ""])))
        invalid = next((n for n in lab.notes if n.startswith("invalid")), "")
        out.append(dict(zip(COLUMNS, [lab.learner, lab.lab, "TOTAL", "total", f"{lab.points:g}",
                                      f"{lab.max_points:g}", invalid, "; ".join(lab.flags), ""])))
    return [{k: clean(v) for k, v in row.items()} for row in out]


def write_rows(table: list[dict], out: Path):
    buf = io.StringIO()
    writer = csv.DictWriter(buf, COLUMNS)
    writer.writeheader()
    writer.writerows(table)
    write_atomic(out, buf.getvalue())


def read_rows(path: Path) -> list[dict]:
    """The rows of a gradebook ``lablib grade`` wrote."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            table = list(reader)
    except FileNotFoundError:
        raise GradebookError(f"{path}: no such gradebook") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise GradebookError(f"{path}: not a gradebook lablib wrote ({exc})") from None
    if reader.fieldnames is None or not set(COLUMNS) - {"detail"} <= set(reader.fieldnames):
        raise GradebookError(f"{path}: not a gradebook lablib wrote (its header is not {','.join(COLUMNS)})")
    return [{k: row.get(k) or "" for k in COLUMNS} for row in table]


def merge(tables: dict[str, list[dict]]) -> list[dict]:
    """One gradebook from several ({where: rows}), learners in order; a learner in two is an error."""
    owner, out = {}, []
    for where, table in tables.items():
        for row in table:
            if owner.setdefault(row["learner"], where) != where:
                raise GradebookError(f"learner {row['learner']} is in both {owner[row['learner']]} and {where}: "
                                     "grade each learner in one shard (--shard K/N with the same N everywhere)")
            out.append(row)
    order = {name: k for k, name in enumerate(sorted(owner))}
    return sorted(out, key=lambda row: order[row["learner"]])  # stable: each learner's rows keep their order


def merge_files(shards: list[Path], out: Path):
    """``lablib grade --merge``: the shards' gradebooks joined into ``out``, their reports into its folder."""
    write_rows(merge({str(path): read_rows(path) for path in shards}), out)
    for path in shards:
        folder = reports_dir(path)
        if folder.is_dir() and folder.resolve() != reports_dir(out).resolve():
            shutil.copytree(folder, reports_dir(out), dirs_exist_ok=True)


# -- the report ------------------------------------------------------------------------------------------
def reports_dir(gradebook) -> Path:
    """Where the per-learner reports of ``gradebook.csv`` go: ``gradebook-reports/`` beside it."""
    gradebook = Path(gradebook)
    return gradebook.with_name(gradebook.stem + "-reports")


def report_name(learner: str) -> str:
    return clean(learner).replace("/", "_") + ".md"


def write_report(labs: list[LabResult], folder: Path, secret: str):
    lines = [f"# {labs[0].learner}".replace("\n", "\\n"), "", f"Checks drew their inputs from the run's secret "
             f"(fingerprint {secret}).", ""]
    for lab in labs:
        lines += [f"## {lab.lab}: {lab.points:g} / {lab.max_points:g} points", ""]
        for note in lab.notes:
            head, *rest = note.split("\n", 1)
            lines += [f"Note: {head}", *(fenced(rest[0]) if rest else []), ""]
        for it in lab.items:
            mark = "✓" if it.points == it.max_points and it.max_points else "✗"
            lines.append(f"- {mark} {it.item} ({it.kind}): {it.status}, {it.points:g}/{it.max_points:g}")
            if it.detail and it.kind == "check" and it.status != "passed":
                lines += ["", *fenced(it.detail, "  "), ""]
        if lab.feedback:
            lines += ["", lab.feedback]
        lines.append("")
    write_atomic(Path(folder) / report_name(labs[0].learner), clean("\n".join(lines)))


# -- an LMS's gradebook import ---------------------------------------------------------------------------
def read_roster(path: Path, lms: str) -> dict[str, dict]:
    """{learner folder: {identity column: value}} from the instructor's roster CSV: a column ``learner``
    (the submission folder's name) and the LMS's identity columns (``LMS[lms]``)."""
    if lms not in LMS:
        raise GradebookError(f"--lms {lms}: choose one of {', '.join(LMS)}")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            table = list(reader)
    except FileNotFoundError:
        raise GradebookError(f"{path}: no such roster (a CSV with a 'learner' column and {lms}'s "
                             f"{', '.join(LMS[lms])})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise GradebookError(f"{path}: the roster is not a UTF-8 CSV file ({exc})") from None
    header = reader.fieldnames or []
    known = [c for c in LMS[lms] if c in header]
    if "learner" not in header or not known:
        raise GradebookError(f"{path}: the roster needs a column 'learner' (each submission folder's name) and "
                             f"at least one of {lms}'s identity columns ({', '.join(LMS[lms])}); it has "
                             f"{', '.join(header) or 'no header'}")
    roster = {}
    for line, row in enumerate(table, start=2):
        name = (row.get("learner") or "").strip()
        if not name or not any((row.get(c) or "").strip() for c in known):
            raise GradebookError(f"{path}, line {line}: a learner and an identity ({', '.join(known)}) are needed")
        if name in roster:
            raise GradebookError(f"{path}, line {line}: learner {name} is listed twice")
        roster[name] = {c: (row.get(c) or "").strip() for c in known}
    return roster


def write_lms(table: list[dict], out: Path, lms: str, roster: dict[str, dict]):
    """The LMS's gradebook import: a row per learner, its identity from ``roster``, a column per lab and a
    total. A learner missing from the roster is an error (its grades would be lost on import)."""
    labs = list(dict.fromkeys(r["lab"] for r in table if r["item"] == "TOTAL"))
    totals = {(r["learner"], r["lab"]): r for r in table if r["item"] == "TOTAL"}
    learners = list(dict.fromkeys(r["learner"] for r in table))
    missing = [name for name in learners if name not in roster]
    if missing:
        raise GradebookError(f"the roster has no row for {', '.join(missing)}: add them (learner and identity) "
                             "and run lablib grade --merge with the gradebook to write the LMS file again")
    given = next(iter(roster.values()), {})
    columns = list(LMS[lms]) if lms == "canvas" else [next(c for c in LMS[lms] if c in given)]  # Moodle maps one
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([*columns, *labs, TOTAL])
    if lms == "canvas":  # its points, for assignments the import creates
        possible = [max((float(totals[(n, lab)]["max_points"]) for n in learners if (n, lab) in totals), default=0)
                    for lab in labs]
        writer.writerow(["    Points Possible", *[""] * (len(columns) - 1), *[f"{p:g}" for p in possible],
                         f"{sum(possible):g}"])
    for name in learners:
        points = [float(totals[(name, lab)]["points"]) if (name, lab) in totals else None for lab in labs]
        writer.writerow([roster[name].get(c, "") for c in columns]
                        + ["" if p is None else f"{p:g}" for p in points] + [f"{sum(p or 0 for p in points):g}"])
    write_atomic(out, buf.getvalue())


# -- JUnit XML -------------------------------------------------------------------------------------------
def write_junit(table: list[dict], out: Path):
    """JUnit XML as pytest and nbval write it: a test suite per learner, a test case per check and quiz
    question (classname ``lablib.<learner>.<lab>``); one short of its points is a failure."""
    suites = ET.Element("testsuites", name="lablib grade")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for learner in dict.fromkeys(r["learner"] for r in table):
        cases = [r for r in table if r["learner"] == learner and r["item"] != "TOTAL"]
        failed = {id(r) for r in cases if float(r["points"]) < float(r["max_points"])}
        suite = ET.SubElement(suites, "testsuite", name=learner, tests=str(len(cases)), failures=str(len(failed)),
                              errors="0", skipped="0", time="0.000", timestamp=stamp, hostname=socket.gethostname())
        for r in cases:
            case = ET.SubElement(suite, "testcase", classname=f"lablib.{learner}.{r['lab']}", name=r["item"],
                                 time="0.000")
            if id(r) in failed:
                failure = ET.SubElement(case, "failure", type=r["kind"],
                                        message=f"{r['status']}: {r['points']}/{r['max_points']} points")
                failure.text = r["detail"] or r["status"]
    ET.indent(suites)
    write_atomic(out, '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n")
