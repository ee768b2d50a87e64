"""The grading box (``lablib grade``): what a learner's box sees (lablib and the virtual environment read-only,
an empty folder over lablib's answers; the answers a lab builds on come as text in the request), how it runs
(runner.py, the supervisor, and executor.py in sandbox.py's box, writing into a tmpfs of its own, its request on
stdin and its results back over a capped pipe), and what grade.py gets back: the records of the check calls it
asked for, and a note on how it ended.
"""
from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .limits import RESULTS_BYTES, SCRATCH_BYTES


def answers_folder() -> Path:
    """A new empty folder to lay over ``lablib/answers`` in a box: no lab's answers are in it."""
    return Path(tempfile.mkdtemp(prefix="lablib-answers-"))  # outside work: the box cannot write into it


def harness(held: tuple) -> dict[str, str]:
    """{module: its text} of the answers modules ``held`` (e.g. ("lab04", "lab05")): the harness a lab builds
    on (``labs.builds_on``), handed to the box's executor as data (executor.load_harness), never as files."""
    source = Path(__file__).resolve().parents[1] / "answers"
    return {name: (source / f"{name}.py").read_text() for name in held}


def run_box(request: list, course, held: tuple = ()) -> tuple[dict, str]:
    """Run the request in a box, the answers modules ``held`` given as data, under ``course``'s limits
    (``grade.Course``); ({call id: record}, a note on how the box ended or "")."""
    from . import sandbox

    work, notes = Path(tempfile.mkdtemp(prefix="lablib-grade-")), []
    answers_dir = answers_folder()
    try:
        nonce = secrets.token_hex(16)
        given = json.dumps({"nonce": nonce, "check_timeout": course.check_timeout, "labs": request,
                            "harness": harness(held)}).encode()
        env = {"LABLIB_QUICK": "1", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "LABLIB_GRADING": "1"}
        # The box writes into a tmpfs of its own and hands its results back over a pipe: no learner's files
        # reach the disk that every box, and the gradebook, share.
        run = sandbox.run([sys.executable, "-m", "lablib.course.runner"], workdir=work, **box_view(answers_dir),
                          env=env, limits=sandbox.Limits(seconds=course.time_limit, cpus=course.cpus), cwd=work,
                          scratch=SCRATCH_BYTES, stdin=given, channel=RESULTS_BYTES)
        wanted = {c["id"] for lab in request for c in lab["calls"]}
        records, duplicated, cells = {}, set(), []
        text = run.data.decode(errors="replace")
        if run.data_over:
            notes.append(f"the grading box sent more than {RESULTS_BYTES >> 20} MiB of results: the checks after that "
                         "count as not run")
            text = text[:text.rfind("\n") + 1]  # the last line, cut, is no record
        for line in io.StringIO(text):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("nonce") == nonce and "cell" in record:
                cells.append(f"{record.get('lab')} {record['cell']} raised {record.get('error')}")
                continue
            if not isinstance(record, dict) or record.get("nonce") != nonce or record.get("id") not in wanted:
                continue
            if record["id"] in records:
                duplicated.add(record["id"])
            records[record["id"]] = record
        for key in duplicated:
            records[key] = {"error": "invalid: two results for one check"}
        notes += [f"exercise code: {c}" for c in cells[:20]]
        if run.reason:
            notes.append(f"the grading box stopped: {run.reason}; checks without a result count as not run")
        elif run.returncode:
            notes.append(f"the grading box ended with exit code {run.returncode}:\n{run.output[-1500:]}")
        if run.warning:
            notes.append(run.warning)
    finally:
        notes.append(_remove(work))
        shutil.rmtree(answers_dir)
    return records, "\n".join(n for n in notes if n)


def box_view(answers: Path) -> dict:
    """What a grading box sees besides its work dir (``sandbox.run``'s readonly and overlays): the virtual
    environment and lablib, read-only, with the folder ``answers`` over ``lablib/answers`` (``answers_folder``:
    empty, so no lab's answers are in the box); the checks' collect steps get what they need of them as data."""
    lablib_dir = Path(__file__).resolve().parents[1]
    return {"readonly": [Path(sys.prefix), lablib_dir], "overlays": {lablib_dir / "answers": answers}}


def _remove(folder: Path) -> str:
    """Remove the box's folder, whatever the learner's code left in it (any modes, any depth: rmtree
    recurses and fails on a deep one); "" or what could not be removed, for the report."""
    def unlock(function, path, _):
        for p in (Path(path).parent, Path(path)):
            try:
                os.chmod(p, 0o700)
            except OSError:
                pass
        function(path)

    try:
        shutil.rmtree(folder, onerror=unlock)
    except (OSError, RecursionError):
        subprocess.run(["chmod", "-R", "u+rwx", "--", str(folder)], capture_output=True, timeout=300)
        subprocess.run(["rm", "-rf", "--", str(folder)], capture_output=True, timeout=300)
    return f"the grading box's folder {folder} could not be removed: remove it by hand" if folder.exists() else ""
