"""Grading (``lablib grade``): every learner's notebooks re-executed under ``pytest --nbval-lax`` after
each graded cell is restored from the release (an edited or deleted check is put back and reported),
then a gradebook (CSV) and a report per learner. See ``lablib grade --help``.
"""
from __future__ import annotations

import copy
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import SANITIZE
from .notebook import ANSWERS, blank, checksum, grade_info, read_notebook
from .release import release_notebook


@dataclass
class Item:
    learner: str
    lab: str
    item: str
    kind: str            # "check" or "quiz"
    points: float
    max_points: float
    status: str          # passed / failed / timed out / not run / correct / wrong / unanswered / missing notebook
    detail: str = ""


@dataclass
class LabResult:
    learner: str
    lab: str
    items: list[Item] = field(default_factory=list)
    tampered: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def points(self) -> float:
        return sum(i.points for i in self.items)

    @property
    def max_points(self) -> float:
        return sum(i.max_points for i in self.items)


def reports_dir(gradebook) -> Path:
    """Where the per-learner reports of ``gradebook.csv`` go: ``gradebook-reports/`` beside it."""
    gradebook = Path(gradebook)
    return gradebook.with_name(gradebook.stem + "-reports")


def restore_graded_cells(submitted, released, reference=None) -> tuple[object, list[str]]:
    """The submitted notebook with every graded cell put back as in ``reference`` (default: the
    release; the source's version when hidden checks should run too).

    Returns (notebook, reports): a report per graded cell that differs from the release (edited) or
    is missing (deleted). A deleted cell is re-inserted after the cell that precedes it in the release
    (matched by grade id or source)."""
    reference = reference or released
    nb = copy.deepcopy(submitted)
    ref_cells = released["cells"]
    as_released = {grade_info(c)["grade_id"]: c for c in ref_cells if grade_info(c)}
    graded = {grade_info(c)["grade_id"]: c for c in reference["cells"] if grade_info(c)}
    reports, kept, seen = [], [], set()
    for cell in nb["cells"]:
        info = grade_info(cell)
        gid = info["grade_id"] if info else None
        if gid in graded:
            if gid in seen:
                reports.append(f"{gid}: duplicated; the copy was removed")
                continue
            seen.add(gid)
            if checksum(cell["source"]) != checksum(as_released[gid]["source"]) or info != grade_info(as_released[gid]):
                reports.append(f"{gid}: edited; restored from the release")
            cell = blank(graded[gid])
        kept.append(cell)
    for i, ref in enumerate(ref_cells):
        info = grade_info(ref)
        if not info or info["grade_id"] in seen:
            continue
        # Re-insert after the reference's previous cell, found in the submission by grade id or source.
        position = 0
        for prev in reversed(ref_cells[:i]):
            pinfo = grade_info(prev)
            match = next((k for k, c in enumerate(kept) if (pinfo and grade_info(c) == pinfo)
                          or (not pinfo and c["source"].strip() == prev["source"].strip() and prev["source"].strip())), None)
            if match is not None:
                position = match + 1
                break
        kept.insert(position, blank(graded[info["grade_id"]]))
        seen.add(info["grade_id"])
        reports.append(f"{info['grade_id']}: deleted; restored from the release")
    nb["cells"] = kept
    return nb, reports


def _code_cell_ids(nb) -> dict[int, str]:
    """nbval's "Cell N" (N counts code cells) -> grade id, for graded cells."""
    out, n = {}, 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            info = grade_info(cell)
            if info:
                out[n] = info["grade_id"]
            n += 1
    return out


def _junit_results(path: Path) -> dict[tuple[str, int], tuple[str, str]]:
    """{(notebook file name, cell number): (status, message)} from pytest's JUnit XML."""
    results = {}
    if not path.exists():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        m = re.match(r"Cell (\d+)$", case.get("name", ""))
        if not m:
            continue
        notebook = case.get("classname", "").split(".ipynb")[0].split(".")[-1].split("/")[-1] + ".ipynb"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            text = (failure.get("message", "") + "\n" + (failure.text or "")).strip()
            status = "timed out" if "Timeout of" in text else "failed"
            results[(notebook, int(m.group(1)))] = (status, _clean_failure(text))
        elif case.find("skipped") is not None:
            results[(notebook, int(m.group(1)))] = ("not run", "skipped")
        else:
            results[(notebook, int(m.group(1)))] = ("passed", "")
    return results


def _clean_failure(text: str) -> str:
    """The last lines that explain a failed cell: the error and its message, without colour codes."""
    text = re.sub(r"(\x1b|#x1B)\[[0-9;]*m", "", text)  # colours, raw or as JUnit XML escapes them
    lines = [line for line in text.splitlines() if line.strip()]
    timeout = next((line.strip() for line in lines if "Timeout of" in line), None)
    if timeout:
        return timeout + " (the kernel was interrupted, and grading went on with the next cell)"
    for k in range(len(lines) - 1, -1, -1):  # from the last exception line on
        if re.match(r"(\w+\.)*\w*(Error|Exception|Interrupt|Failed)\b", lines[k].strip()):
            return "\n".join(lines[k:k + 12])
    return "\n".join(lines[-8:])


def _kill_tagged(tag: str):
    """Kill every process whose environment carries ``LABLIB_GRADE_TAG=tag`` (kernels, their ranks)."""
    needle = f"LABLIB_GRADE_TAG={tag}".encode()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _run_nbval(workdir: Path, notebooks: list[str], cell_timeout: float, total_timeout: float) -> tuple[Path, str]:
    junit = workdir / ".junit.xml"
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("LABLIB_ANSWERS")}
    env["LABLIB_GRADE_TAG"] = tag
    env["LABLIB_QUICK"] = "1"  # grading checks the work; the labs' long measurements need not run in full
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "--nbval-lax",
           "--nbval-current-env", f"--nbval-cell-timeout={cell_timeout:g}", f"--junitxml={junit}",
           "--rootdir", str(workdir), "-q"]
    if SANITIZE.exists():
        cmd.append(f"--nbval-sanitize-with={SANITIZE}")
    proc = subprocess.Popen(cmd + notebooks, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    note = ""
    try:
        out, _ = proc.communicate(timeout=total_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        note = f"grading stopped after {total_timeout:.0f} s; cells not reached count as not run"
    finally:
        _kill_tagged(tag)  # nothing the learner's notebook started outlives its grading
    if proc.returncode not in (0, 1) and not junit.exists():
        note = note or f"pytest could not run this learner's notebooks:\n{out[-2000:]}"
    return junit, note


def grade(submissions, release_dir, out, source_dir=None, cell_timeout: float = 120.0) -> list[LabResult]:
    """Grade every learner folder in ``submissions``; write the gradebook CSV ``out`` and a report per
    learner in ``reports_dir(out)``. Returns the results."""
    submissions, release_dir, out = Path(submissions), Path(release_dir), Path(out)
    releases = {p.name: read_notebook(p) for p in sorted(release_dir.glob("*.ipynb"))}
    if not releases:
        raise FileNotFoundError(f"{release_dir}: no released notebooks to grade against")
    if not submissions.is_dir():
        raise FileNotFoundError(f"{submissions}: no such folder of submissions (one folder per learner)")
    references = dict(releases)
    if source_dir is not None:  # hidden checks run too: graded cells come from the source
        references = {name: release_notebook(read_notebook(Path(source_dir) / name), name,
                                             keep_hidden=True) for name in releases}
    learners = sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    results: list[LabResult] = []
    for folder in learners:
        results += _grade_learner(folder, releases, references, cell_timeout)
    _write_gradebook(results, out)
    _write_reports(results, reports_dir(out))
    return results


def _grade_learner(folder: Path, releases, references, cell_timeout) -> list[LabResult]:
    from .. import quiz

    learner = folder.name
    work = Path(tempfile.mkdtemp(prefix=f"lablib-grade-{learner}-"))
    try:
        labs, present = {}, {}  # present: notebook name -> the restored notebook that is run
        for name, reference in references.items():
            lab = LabResult(learner, Path(name).stem)
            labs[name] = lab
            submitted_path = folder / name
            if not submitted_path.exists():
                lab.note = "notebook not submitted"
                continue
            try:
                submitted = read_notebook(submitted_path)
            except Exception as exc:  # unreadable JSON: graded 0, grading goes on
                lab.note = f"notebook could not be read: {exc}"
                continue
            restored, lab.tampered = restore_graded_cells(submitted, releases[name], reference)
            (work / name).write_text(json.dumps(restored, indent=1, ensure_ascii=False))
            present[name] = restored
        if (folder / ANSWERS).exists():
            shutil.copy2(folder / ANSWERS, work / ANSWERS)
        cells = sum(sum(c["cell_type"] == "code" for c in references[n]["cells"]) for n in present)
        junit, note = (_run_nbval(work, list(present), cell_timeout, cell_timeout * cells + 300) if present
                       else (work / ".none", ""))
        results = _junit_results(junit)
        store = quiz.AnswerStore(work / ANSWERS)
        answers = store.load()
        for name, lab in labs.items():
            lab.note = lab.note or note
            points = {info["grade_id"]: float(info["points"]) for info in map(grade_info, references[name]["cells"])
                      if info}
            for number, gid in _code_cell_ids(present.get(name, references[name])).items():
                status, detail = results.get((name, number), ("not run", lab.note))
                if name not in present:
                    status, detail = "missing notebook", lab.note
                lab.items.append(Item(learner, lab.lab, gid, "check", points[gid] if status == "passed" else 0.0,
                                      points[gid], status, detail))
            try:
                lab_questions = quiz.questions(lab.lab)
            except KeyError:
                lab_questions = []
            for q in lab_questions:
                rec = answers.get(q.ref)
                status = q.status(rec)
                lab.items.append(Item(learner, lab.lab, q.ref, "quiz", float(status == "correct"), 1.0, status,
                                      "" if rec is None else f"attempts: {rec.get('attempts', 1)}"))
            if store.warning:
                lab.note = (lab.note + "\n" if lab.note else "") + store.warning
        return list(labs.values())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_gradebook(results: list[LabResult], out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", "lab", "item", "kind", "points", "max_points", "status"])
        for lab in results:
            for it in lab.items:
                writer.writerow([it.learner, it.lab, it.item, it.kind, f"{it.points:g}", f"{it.max_points:g}", it.status])
            writer.writerow([lab.learner, lab.lab, "TOTAL", "total", f"{lab.points:g}", f"{lab.max_points:g}",
                             f"tampered: {len(lab.tampered)}" if lab.tampered else ""])


def _write_reports(results: list[LabResult], folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    by_learner: dict[str, list[LabResult]] = {}
    for lab in results:
        by_learner.setdefault(lab.learner, []).append(lab)
    for learner, labs in by_learner.items():
        lines = [f"# {learner}", ""]
        for lab in labs:
            lines += [f"## {lab.lab}: {lab.points:g} / {lab.max_points:g} points", ""]
            if lab.note:
                lines += [f"Note: {lab.note}", ""]
            for t in lab.tampered:
                lines.append(f"- Tampered check cell {t}.")
            for it in lab.items:
                mark = "✓" if it.points == it.max_points and it.max_points else "✗"
                lines.append(f"- {mark} {it.item} ({it.kind}): {it.status}, {it.points:g}/{it.max_points:g}")
                if it.detail and it.kind == "check" and it.status != "passed":
                    lines += ["", "  ```", *[f"  {d}" for d in it.detail.splitlines()], "  ```", ""]
            lines.append("")
        (folder / f"{learner}.md").write_text("\n".join(lines))
