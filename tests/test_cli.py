"""The `lablib` command, the package metadata and the environment files."""
import importlib.metadata as md
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency reads TOML the same way
    import tomli as tomllib

from lablib import doctor

ROOT = Path(__file__).resolve().parents[1]


def test_doctor_runs_a_real_smoke_test_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "lablib", "doctor"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"smoke test\s+2-rank all_reduce -> \[3\.0, 3\.0\]\s+ok", out.stdout)
    assert re.search(r"backend\s+auto -> (Gloo \(CPU\)|NCCL \(one GPU per rank\)) for 2 ranks", out.stdout)
    assert "CPU cores" in out.stdout and "GPUs" in out.stdout
    # a warning line exactly for what runs outside the tested range (none in CI)
    warnings = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("warning:")]
    expected = [doctor.untested("python", platform.python_version()), doctor.untested("torch", md.version("torch"))]
    assert warnings == [w for w in expected if w]


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("lablib")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "doctor" in out.stdout


@pytest.mark.parametrize("requirement, reason", [
    (("lablib-no-such-package", "1.0", "testing"), r"lablib-no-such-package is not installed \(needed for testing\)"),
    (("numpy", "999.0", "testing"), "numpy .* is too old: >= 999.0 is needed for testing"),
])
def test_doctor_fails_with_a_clear_reason(monkeypatch, capsys, requirement, reason):
    reqs = doctor.requirements()
    assert {name for name, _, _ in reqs} >= {"torch", "numpy", "cloudpickle", "jupyterlab", "ipywidgets", "plotly"}
    monkeypatch.setattr(doctor, "requirements", lambda: reqs + [requirement])
    assert doctor.doctor() == 1
    out = capsys.readouterr().out
    assert "problems:" in out and re.search(reason, out)
    assert "smoke test" not in out  # no processes started when the installation is incomplete


@pytest.mark.parametrize("name, version, tested", [
    ("python", "3.9.18", False), ("python", "3.10.0", True), ("python", "3.13.9", True), ("python", "3.14.0", False),
    ("torch", "2.7.1", False), ("torch", "2.8.0", True), ("torch", "2.13.0+cpu", True), ("torch", "2.15.1", True),
    ("torch", "2.16.0.dev20270101+cpu", False), ("torch", "3.0.0", False),
])
def test_versions_outside_the_tested_range_are_named(name, version, tested):
    warning = doctor.untested(name, version)
    if tested:
        assert warning is None
    else:
        first, last = doctor.TESTED[name]
        assert f"running {'Python' if name == 'python' else name} {version}," in warning
        assert f"tested with {'Python' if name == 'python' else name} {first} to {last}" in warning
        assert "it may still work" in warning


def test_doctor_warns_in_one_line_when_torch_is_outside_the_tested_range(monkeypatch, capsys):
    monkeypatch.setitem(doctor.TESTED, "torch", ("2.0", "2.1"))  # a range the installed torch (>= 2.8) is not in
    assert doctor.environment() == []  # a warning, not a problem
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines() if "warning:" in line]
    assert lines == [f"warning: running torch {md.version('torch')}, but the course was tested with torch 2.0 to 2.1 "
                     "(see docs/clusters.md, Tested versions): it may still work"]


def test_the_tested_range_is_the_one_the_docs_and_pyproject_state():
    readme = (ROOT / "docs" / "clusters.md").read_text()
    section = readme.split("## Tested versions\n", 1)[1].split("\n#", 1)[0]
    t = doctor.TESTED
    for words in (f"Python {t['python'][0]} to {t['python'][1]}", f"torch {t['torch'][0]} to {t['torch'][1]}",
                  f"JupyterLab {t['jupyterlab'][0]}", f"ipywidgets {t['ipywidgets'][0]}"):
        assert words in section, words
    rows = re.findall(r"^\| (\d+\.\d+)\.\d+ \| (\d+\.\d+)\.\d+", section, re.M)
    assert len(rows) >= 2
    for python, torch in rows:
        assert doctor.untested("python", python) is None and doctor.untested("torch", torch) is None
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={t['python'][0]}"  # the oldest tested is the oldest accepted
    assert f"torch>={t['torch'][0]}" in project["dependencies"]


def test_doctor_notes_a_cuda_build_on_a_machine_without_a_gpu():
    note = doctor.cuda_build_note("13.0", 0)
    assert "CUDA build" in note and "no GPU" in note and f"TORCH_INDEX_URL={doctor.CPU_INDEX}" in note
    assert doctor.cuda_build_note("13.0", 1) is None and doctor.cuda_build_note(None, 0) is None


def test_a_cuda_build_without_a_gpu_does_not_print_kineto_s_complaint_in_a_cell():
    from lablib.pool.job import noise

    # what the profiler of a CUDA build prints at each start on a machine with no GPU (lab 03, section 7)
    assert noise("WARNING:2026-12-01 10:00:00 1234:1234 DeviceUtil.cpp:39] gpuGetDeviceCount failed with code 35\n")
    assert noise("USDT:2026-12-01 20:06:55 12320:12320 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    assert not noise("RuntimeError: CUDA error: no kernel image is available\n")


def test_doctor_rejects_a_bad_rank_count():
    out = subprocess.run([sys.executable, "-m", "lablib", "doctor", "--ranks", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and "expected a whole number of ranks >= 1" in out.stderr


def _names(specs):
    return {re.split(r"[<>=!\s\[;]", s.strip(), maxsplit=1)[0].lower() for s in specs}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"]) | _names(project["optional-dependencies"]["test"])
    conda = set()
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"\s+-\s+([A-Za-z][\w.-]*)", line)
        if m:
            conda.add(m.group(1).lower())
    conda = {"torch" if n == "pytorch" else n for n in conda}
    assert wanted - conda == set(), f"in pyproject.toml but not environment.yml: {wanted - conda}"
