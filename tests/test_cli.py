"""The `lablib` command, the package metadata and the environment files."""
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
