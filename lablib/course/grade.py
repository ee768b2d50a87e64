"""Grading (``lablib grade``): each learner's exercise code runs in a box, the data it produces is judged
outside the box, and a gradebook (CSV) and a report per learner are written. See ``lablib grade --help``
and docs/instructors.md.

Per learner: every notebook is read as data (never run whole). exercises.py takes the exercise code and
the check calls of the instructor's release (plus the hidden ones of the source), refuses code that
breaks the rules, and executor.py, inside the box (sandbox.py) under its supervisor runner.py, runs the
rest, compiled with the guards (rules/guards.py): the learner's definitions and each check's ``collect``.
Here each check's ``judge`` reads the plain data (plain.py) and computes its own reference. Quizzes are
scored from the answers file with the instructor's banks. A submission that cannot be read is graded
"invalid: reason", and grading goes on with the next learner.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..checks import CheckFailed
from . import box
from .exercises import check_calls, dictated, exercise_code, normalised, refusal, solutions
from .gradebook import Item, LabResult, merge, read_rows, reports_dir, rows, write_report, write_rows
from .limits import CHECK_TIMEOUT, TIME_LIMIT
from .notebook import ANSWERS

MAX_FILE = 50 << 20          # bytes of one submitted file


class Invalid(ValueError):
    """A submitted file that cannot be graded; the message says why."""


# -- reading what a learner submitted ------------------------------------------------------------------
def read_file(path: Path) -> str:
    """A submitted file's text: a plain file (not a link, not a folder), at most MAX_FILE bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Invalid(f"{path.name} cannot be opened ({exc.strerror}); submit a plain file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Invalid(f"{path.name} is not a plain file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE + 1)
    if len(raw) > MAX_FILE:
        raise Invalid(f"{path.name} is over {MAX_FILE >> 20} MB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid(f"{path.name} is not UTF-8 text") from None


def read_submission(path: Path) -> dict:
    """A submitted notebook as plain JSON, every cell checked for the fields grading reads."""
    try:
        nb = json.loads(read_file(path))
    except ValueError as exc:
        raise Invalid(f"{path.name} is not valid JSON ({exc})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise Invalid(f"{path.name} is not a notebook: no list of cells")
    for k, cell in enumerate(nb["cells"]):
        where = f"{path.name}, cell {k}"
        if not isinstance(cell, dict):
            raise Invalid(f"{where} is not an object")
        if cell.get("cell_type") not in ("code", "markdown", "raw"):
            raise Invalid(f"{where} has no valid cell_type")
        source = cell.get("source")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            cell["source"] = "".join(source)
        elif not isinstance(source, str):
            raise Invalid(f"{where} has no source text")
        metadata = cell.setdefault("metadata", {})
        if not isinstance(metadata, dict):
            raise Invalid(f"{where} has metadata that is not an object")
        info = metadata.get("lablib")
        if info is not None and not (isinstance(info, dict) and isinstance(info.get("grade_id", ""), str)):
            raise Invalid(f"{where} has lablib metadata that is not an object with a text grade_id")
    return nb


def read_answers(folder: Path) -> tuple[dict, str]:
    """(the answers mapping, a note) from the learner's quiz_answers.json; {} with a note when unreadable."""
    try:
        data = json.loads(read_file(folder / ANSWERS))
    except FileNotFoundError:
        return {}, ""
    except (Invalid, ValueError) as exc:
        return {}, f"invalid: {ANSWERS}: {exc}"
    answers = data.get("answers") if isinstance(data, dict) else None
    if not isinstance(answers, dict):
        return {}, f"invalid: {ANSWERS} holds no answers mapping"
    return answers, ""


# -- grading -----------------------------------------------------------------------------------------
@dataclass
class Course:
    """What every learner is graded against: trusted notebooks, check calls, banks, the run's secret."""
    releases: dict
    calls: dict            # notebook name -> {grade_id: [Call]}
    points: dict           # notebook name -> {grade_id: points}
    solutions: dict        # notebook name -> {function name: its solution's code}, those the stub does not dictate
    banks: dict
    secret: bytes          # 128 bits the checks' inputs are drawn from (exercises.call_seed)
    check_timeout: float
    time_limit: float
    cpus: float | None = None  # each box's CPU share, in cores (graded beside others), or the whole machine


def parse_secret(secret: str | bytes | None) -> bytes:
    """The run's secret: 16 bytes, from 32 hex digits (``--secret``, to grade again on the same inputs), or drawn
    at random."""
    if secret is None:
        return secrets.token_bytes(16)
    if isinstance(secret, bytes) and len(secret) == 16:
        return secret
    text = str(secret).strip().lower()
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"--secret takes 32 hex digits (128 bits), got {text[:40]!r}; leave it out to draw one")
    return bytes.fromhex(text)


def fingerprint(secret: bytes) -> str:
    """Names a run's secret in reports (which learners may read) without giving it away."""
    return hashlib.sha256(secret).hexdigest()[:12]


def grade(submissions, release_dir, out, source_dir=None, check_timeout: float = CHECK_TIMEOUT,
          time_limit: float = TIME_LIMIT, secret: str | bytes | None = None, banks_dir=None, jobs: int = 1,
          shard: tuple[int, int] = (1, 1), only: str | None = None) -> list[LabResult]:
    """Grade every learner folder in ``submissions``; write the gradebook CSV ``out`` (after each learner,
    atomically) and a report per learner in ``reports_dir(out)``. Returns the results, in learner order.
    ``jobs``: learners graded at once, each in its own box (what one learner waits for, a hanging check
    say, then overlaps the others' work). ``shard`` (k, n): only every n-th learner from the k-th (1-based),
    for a class spread over machines (``lablib grade --merge`` joins their gradebooks). ``only``: that
    learner alone, their rows replacing theirs in an existing ``out``, every other row kept.

    With ``jobs`` > 1 each box gets its share of the cores (a cgroup CPU quota, where the controller is
    delegated), and a learner whose grading reached a time limit is graded again alone once the others are
    done, before that is reported: a time limit reached beside others may be theirs."""
    from ..quiz.bank import default_dir, load_all
    from .notebook import read_notebook

    submissions, release_dir, out = Path(submissions), Path(release_dir), Path(out)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number >= 1, got {jobs!r}")
    k, n = shard
    if not 1 <= k <= n:
        raise ValueError(f"shard {k}/{n}: K/N needs 1 <= K <= N (the K-th of N shards)")
    releases = {p.name: read_notebook(p) for p in sorted(release_dir.glob("*.ipynb"))}
    if not releases:
        raise FileNotFoundError(f"{release_dir}: no released notebooks to grade against")
    if not submissions.is_dir():
        raise FileNotFoundError(f"{submissions}: no such folder of submissions (one folder per learner)")
    learners = learner_folders(submissions)[k - 1::n]
    keep = []  # the rows of other learners, with only=
    if only is not None:
        learners = [p for p in learners if p.name == only]
        if not learners:
            raise FileNotFoundError(f"{submissions / only}: no such learner folder")
        keep = [r for r in read_rows(out) if r["learner"] != only] if out.exists() else []
    sources = {name: read_notebook(Path(source_dir) / name) for name in releases} if source_dir else {}
    secret = parse_secret(secret)
    course = Course(releases, {}, {}, {}, load_all(Path(banks_dir) if banks_dir else default_dir()), secret,
                    check_timeout, time_limit, max(1.0, (os.cpu_count() or 1) / jobs) if jobs > 1 else None)
    for name, nb in releases.items():
        course.calls[name], course.points[name] = check_calls(nb, sources.get(name), secret)
        # the solutions a copy of which is flagged: not those the stub dictates
        free = dictated(sources[name]) if name in sources else set()
        course.solutions[name] = {f: code for f, code in solutions(sources[name]).items() if f not in free} \
            if name in sources else {}
    done: dict[Path, list[LabResult]] = {}
    lock = threading.Lock()
    write_rows(keep, out)  # a shard with no learners still has its gradebook

    again = []  # learners who reached a time limit beside others: graded again alone

    def one(folder, alone=False):
        try:  # one learner never stops the others: whatever fails, they get rows
            labs = grade_learner(folder, course if not alone else dataclasses.replace(course, cpus=None))
        except Exception as exc:  # noqa: BLE001
            labs = [LabResult(folder.name, Path(n).stem, notes=[f"invalid: grading failed: {type(exc).__name__}: {exc}"])
                    for n in releases]
            for lab, name in zip(labs, releases):
                lab.items = [Item(lab.learner, lab.lab, gid, "check", 0.0, p, "invalid")
                             for gid, p in course.points[name].items()]
        if jobs > 1 and not alone and timed_out(labs):
            with lock:
                again.append(folder)
            return
        try:
            write_report(labs, reports_dir(out), fingerprint(course.secret))
        except Exception as exc:  # noqa: BLE001
            labs[0].flags.append(f"report: not written ({type(exc).__name__}: {exc})")
        with lock:  # the gradebook holds every learner graded so far, in learner order
            done[folder] = labs
            write_rows(merge({str(out): keep, "this run": rows([lab for f in learners if f in done for lab in done[f]])}),
                       out)

    if jobs == 1:
        for folder in learners:
            one(folder)
    else:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="lablib-grade") as pool:
            list(pool.map(one, learners))
        for folder in sorted(again):
            one(folder, alone=True)
    return [lab for f in learners for lab in done[f]]


TIMED_OUT = ("timed out after", "stopped after", "time limit", "TimeoutError", "timeout")


def timed_out(labs: list[LabResult]) -> bool:
    """Whether a learner's grading reached a time limit somewhere: the box's, a check's, or a rank's wait."""
    return any(word in text for lab in labs for text in [*lab.notes, *(i.detail for i in lab.items)]
               for word in TIMED_OUT)


def learner_folders(submissions: Path) -> list[Path]:
    """The learner folders of ``submissions``, in order: folders, not links, not hidden."""
    return sorted(p for p in Path(submissions).iterdir()
                  if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def grade_learner(folder: Path, course: Course) -> list[LabResult]:
    learner = folder.name
    labs, request, pending = {}, [], {}
    for name in course.releases:
        lab = labs[name] = LabResult(learner, Path(name).stem)
        try:
            nb = read_submission(folder / name)
        except FileNotFoundError:
            lab.notes.append("notebook not submitted")
            lab.items = [Item(learner, lab.lab, gid, "check", 0.0, p, "missing notebook")
                         for gid, p in course.points[name].items()]
            continue
        except Invalid as exc:
            lab.notes.append(f"invalid: {exc}")
            lab.items = [Item(learner, lab.lab, gid, "check", 0.0, p, "invalid", str(exc))
                         for gid, p in course.points[name].items()]
            continue
        ex = exercise_code(nb)
        lab.notes += ex.notes
        flagged = set()
        runnable = []
        for gid, calls in course.calls[name].items():
            why = next((r for r in (refusal(c, ex) for c in calls) if r), "")
            if why:
                lab.items.append(Item(learner, lab.lab, gid, "check", 0.0, course.points[name][gid], "refused", why))
                continue
            pending[(name, gid)] = calls
            runnable += calls
            for fn in sorted({p for c in calls for p in c.params} - flagged):  # a later task's check may take it too
                solution = course.solutions[name].get(fn)
                if solution is not None and normalised(solution) == normalised(ex.functions[fn]):
                    lab.flags.append(f"{gid}: {fn} matches the solution's code")
                    flagged.add(fn)
        if runnable:
            request.append({"lab": lab.lab, "cells": ex.cells, "calls": [
                {"id": f"{name}:{c.id}", "group": f"{name}:{c.grade_id}", "module": c.module, "check": c.check, "params": list(c.params),
                 "world_size": c.world_size, "seed": c.seed, "given": c.given()} for c in runnable]})
    records, box_note = run_boxes(request, course)
    for (name, gid), calls in pending.items():
        lab = labs[name]
        lab.items.append(judge(lab, gid, calls, records, name, course.points[name][gid], box_note))
    for lab in labs.values():
        lab.items.sort(key=lambda it: list(course.points[f"{lab.lab}.ipynb"]).index(it.item))
        if box_note:
            lab.notes.append(box_note)
    answers, note = read_answers(folder)
    _quiz(labs, answers, note, course)
    return list(labs.values())


def judge(lab: LabResult, gid: str, calls, records: dict, name: str, points: float, box_note: str) -> Item:
    """One graded cell's item: passed only when every call (visible and hidden) passed."""
    from .plain import NotPlain, loads

    texts = []
    for call in calls:
        record = records.get(f"{name}:{call.id}")
        which = " (a hidden check, other inputs)" if call.hidden else ""
        if record is None:
            return Item(lab.learner, lab.lab, gid, "check", 0.0, points, "not run",
                        box_note or "no result came back from the box")
        if "error" in record:
            return Item(lab.learner, lab.lab, gid, "check", 0.0, points, "failed", str(record["error"]) + which)
        try:
            texts.append(call.judge(loads(record["data"])))
        except CheckFailed as exc:
            return Item(lab.learner, lab.lab, gid, "check", 0.0, points, "failed", f"{exc}{which}")
        except (NotPlain, ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
            return Item(lab.learner, lab.lab, gid, "check", 0.0, points, "failed",
                        f"the data your code returned could not be judged ({type(exc).__name__}: {exc}){which}")
    return Item(lab.learner, lab.lab, gid, "check", points, points, "passed", texts[-1] if texts else "")


def run_boxes(request: list, course: Course) -> tuple[dict, str]:
    """The request's labs in one box, but a lab that builds on earlier labs' answers (``labs.builds_on``)
    in a box of its own, given those as data; ({call id: record}, the boxes' notes)."""
    from ..labs import builds_on

    parts: dict[tuple, list] = {}
    for lab in request:
        parts.setdefault(builds_on(lab["lab"]), []).append(lab)
    records, notes = {}, []
    for held, labs in parts.items():
        got, note = box.run_box(labs, course, held)
        records.update(got)
        notes.append(note)
    return records, "\n".join(n for n in notes if n)


def _quiz(labs: dict, answers: dict, note: str, course: Course):
    from ..quiz.grading import feedback, grade_lab

    for lab in labs.values():
        for q in grade_lab(lab.lab, answers, course.banks):
            lab.items.append(Item(lab.learner, lab.lab, q.ref, "quiz", q.points, q.max_points,
                                  "invalid" if note else q.status, note or q.detail))
        if note:
            lab.notes.append(note)
        lab.feedback = feedback(lab.lab, answers, course.banks)
