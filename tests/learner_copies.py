"""Every learner copy run as nbval runs it, in two pytest processes (half the labs each), for
tests/test_release.py. In the whole suite they start with the first source notebook and run beside the
sources' own run (conftest.py), where the cores are often idle (kernels starting, simulated links and
compute waiting); test_release.py's checks of them are moved to the end of the session to read them."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "sources").glob("*.ipynb"))
TESTS = "tests/test_release.py::test_untouched_learner_copy_fails_its_checks_and_only_them"
_RUNS: list = []  # (JUnit XML path, the pytest process), and the folder they write to last


def start() -> None:
    """Start the two runs, once."""
    if _RUNS:
        return
    tmp = Path(tempfile.mkdtemp(prefix="lablib-learner-copies-"))
    for k, half in enumerate((SOURCES[0::2], SOURCES[1::2])):
        junit = tmp / f"junit{k}.xml"
        _RUNS.append((junit, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
             "--rootdir", str(ROOT), *(str(ROOT / "labs" / s.name) for s in half)], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "LABLIB_ANSWERS": str(tmp / f"quiz_answers{k}.json")})))
    _RUNS.append(tmp)


def results() -> dict[tuple[str, int], tuple[str, str]]:
    """{(notebook file name, cell number): (status, failure text)} once both runs have ended."""
    start()
    out = {}
    for junit, proc in _RUNS[:-1]:
        proc.wait(timeout=1800)
        out.update(_junit_results(junit))
    return out


def stop() -> None:
    """A run still going is stopped, not left behind; their folder is removed."""
    for junit, proc in _RUNS[:-1]:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if _RUNS:
        shutil.rmtree(_RUNS[-1], ignore_errors=True)
    _RUNS.clear()


def _junit_results(path) -> dict[tuple[str, int], tuple[str, str]]:
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        m = re.match(r"Cell (\d+)$", case.get("name", ""))
        if m:
            notebook = case.get("classname", "").split(".ipynb")[0].split(".")[-1].split("/")[-1] + ".ipynb"
            failure = case.find("failure") if case.find("failure") is not None else case.find("error")
            text = "" if failure is None else failure.get("message", "") + "\n" + (failure.text or "")
            results[(notebook, int(m.group(1)))] = ("passed" if failure is None else "failed", text)
    return results
