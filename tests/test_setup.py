"""./lab.sh: its arguments, the learner's working copy, root in a container and the choice of torch build.

The choices are tested through lab.sh's own functions (`source lab.sh` runs nothing), with the
probes pointed at files and local servers this test makes, so no test depends on the machine's GPU
or network; the one that asks the real CPU index skips, saying why, where it cannot be reached.
"""
import functools
import http.server
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB_SH = ROOT / "lab.sh"
VENV = ROOT / ".venv"
STAMP = VENV / ".lablib-installed"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REFUSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
LABS = sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LABSH_") and k not in ("TORCH_INDEX_URL", "MY_LABS")}
    env.update(extra)
    return env


def _venv_ready():
    """lab.sh starts at once only when its stamp is newer than pyproject.toml; else it would install."""
    if not (VENV / "bin" / "jupyter").exists() or not STAMP.exists():
        return False
    return STAMP.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime


needs_venv = pytest.mark.skipif(not _venv_ready(), reason="needs the set-up done: run ./lab.sh once (else this test would install the course)")
linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="the CPU build is chosen on Linux only (elsewhere PyPI's torch has no CUDA)")


def lab_sh(*args, env=None, timeout=120, script=LAB_SH):
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env or _env(), timeout=timeout)


def sourced(code, cwd=ROOT, env=None, timeout=60):
    """Run bash code after `source lab.sh`, which defines lab.sh's functions and runs nothing."""
    return subprocess.run(["bash", "-c", f'source "{LAB_SH}"\n{code}'], capture_output=True, text=True,
                          cwd=cwd, env=env or _env(), timeout=timeout)


# --- arguments ---------------------------------------------------------------------------------


def _jupyterlab_version():
    (dist,) = VENV.glob("lib/python*/site-packages/jupyterlab-*.dist-info")
    return re.search(r"^Version: (.+)$", (dist / "METADATA").read_text(), re.M).group(1)


@needs_venv
def test_options_go_to_jupyter_lab(tmp_path):
    env = _env(MY_LABS=str(tmp_path / "my-labs"))
    for args in (["--version"], ["lab", "--version"]):  # the subcommand form still works
        out = lab_sh(*args, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout == _jupyterlab_version() + "\n"
        assert "usage" not in out.stderr
        # as root, one line says --allow-root was added; for anyone else, nothing is added
        assert ("lab.sh: running as root (as in a container): adding --allow-root" in out.stderr) == (os.geteuid() == 0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_venv
def test_no_browser_and_port_start_jupyterlab_on_the_working_copy(tmp_path):
    """The issue's command line, for real: JupyterLab answers on the port, serving my-labs/ (as root too)."""
    port = _free_port()
    my_labs = tmp_path / "my-labs"
    log = (tmp_path / "lab.log").open("w")
    proc = subprocess.Popen(["bash", str(LAB_SH), "--no-browser", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=_env(MY_LABS=str(my_labs), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime")), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api", timeout=5) as r:
                    assert "version" in json.load(r)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer on port {port} (exit {proc.poll()}):\n{(tmp_path / 'lab.log').read_text()}")
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (tmp_path / "lab.log").read_text()
    assert "usage" not in text
    assert f"Serving notebooks from local directory: {my_labs}" in text
    assert ("adding --allow-root" in text) == (os.geteuid() == 0)


@pytest.mark.parametrize("word", ["frobnicate", "labs/00_welcome.ipynb", "tests", ""])
def test_an_unknown_word_prints_usage_before_anything_is_installed(tmp_path, word):
    script = tmp_path / "lab.sh"
    shutil.copy(LAB_SH, script)
    # a PYTHON that fails: had lab.sh gone on to set up, it would stop with "Python 3.10 or newer is needed", exit 1
    out = lab_sh(word, script=script, env=_env(PYTHON=str(tmp_path / "no-such-python")))
    assert out.returncode == 2
    assert out.stderr.startswith("usage: ./lab.sh [lab] [jupyter lab options] | test [pytest args]"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.sh"]  # no .venv, no my-labs


def test_options_are_not_rejected_before_the_set_up(tmp_path):
    """The same empty folder with an option instead: lab.sh goes on to the set-up (which stops on the bad PYTHON)."""
    script = tmp_path / "lab.sh"
    shutil.copy(LAB_SH, script)
    out = lab_sh("--no-browser", "--port", "8899", script=script, env=_env(PYTHON=str(tmp_path / "no-such-python")))
    assert out.returncode == 1 and "Python 3.10 or newer is needed" in out.stderr and "usage" not in out.stderr
    assert not (tmp_path / ".venv").exists()


def test_help_installs_nothing(tmp_path):
    script = tmp_path / "lab.sh"
    shutil.copy(LAB_SH, script)
    out = lab_sh("--help", script=script, env=_env(PYTHON=str(tmp_path / "no-such-python")))
    assert out.returncode == 0 and "./lab.sh test [..]" in out.stdout and "--allow-root" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lab.sh"]


@needs_venv
def test_test_subcommand_passes_its_arguments_to_pytest():
    """.ci/run calls `./lab.sh test`: the subcommand and its pytest arguments work as before."""
    out = lab_sh("test", "--collect-only", "-q", "tests/test_cli.py", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tests/test_cli.py::test_console_script_is_installed" in out.stdout


# --- root --------------------------------------------------------------------------------------


def _lab_args(uid, *args):
    out = sourced(f'jupyter_lab_args {uid} {" ".join(args)}\nprintf "%s\\n" ${{LAB_ARGS[@]+"${{LAB_ARGS[@]}}"}}')
    assert out.returncode == 0, out.stderr
    return out.stdout.split(), out.stderr


def test_root_gets_allow_root_and_is_told():
    args, said = _lab_args(0, "--no-browser", "--port", "8899")
    assert args == ["--no-browser", "--port", "8899", "--allow-root"]
    assert said == "lab.sh: running as root (as in a container): adding --allow-root, without which JupyterLab refuses to start\n"


def test_other_users_and_an_explicit_allow_root_are_left_alone():
    assert _lab_args(1000, "--no-browser") == (["--no-browser"], "")
    assert _lab_args(1000) == ([], "")
    assert _lab_args(0, "--allow-root") == (["--allow-root"], "")


# --- which torch -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def index_that_answers(tmp_path_factory):
    """A local stand-in for the CPU index: it serves <index>/torch/."""
    root = tmp_path_factory.mktemp("index")
    (root / "torch").mkdir()
    (root / "torch" / "index.html").write_text("<html><body></body></html>")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def choose(tmp_path, *, driver, index, torch_index_url=None):
    """lab.sh's choice, with the driver present or absent and the CPU index at `index`."""
    absent = str(tmp_path / "absent")
    env = _env(LABSH_NVIDIA_SMI=absent, LABSH_NVIDIA_PATHS=absent, LABSH_CPU_INDEX=index)
    if driver == "proc":  # /proc/driver/nvidia, as the driver makes it
        (tmp_path / "proc-nvidia").mkdir(exist_ok=True)
        env["LABSH_NVIDIA_PATHS"] = f"{absent} {tmp_path / 'proc-nvidia'}"
    elif driver == "nvidia-smi":  # the command on PATH
        smi = tmp_path / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
        env["LABSH_NVIDIA_SMI"] = str(smi)
    if torch_index_url:
        env["TORCH_INDEX_URL"] = torch_index_url
    start = time.monotonic()
    out = sourced(f'choose_torch_index "{sys.executable}"; printf "%s\\n%s\\n" "$TORCH_INDEX" "$TORCH_REASON"', env=env)
    assert out.returncode == 0, out.stderr
    chosen, reason = out.stdout.split("\n")[:2]
    return chosen, reason, time.monotonic() - start


@linux_only
@pytest.mark.parametrize("driver", ["proc", "nvidia-smi"])
@pytest.mark.parametrize("answers", [True, False], ids=["index answers", "index refuses"])
def test_with_an_nvidia_driver_torch_comes_from_the_default_index(tmp_path, index_that_answers, driver, answers):
    chosen, reason, _ = choose(tmp_path, driver=driver, index=index_that_answers if answers else REFUSED)
    assert chosen == ""
    assert reason == "NVIDIA driver found: installing torch from pip's default index (the CUDA build, several GB)"


@linux_only
def test_without_a_driver_the_cpu_index_is_used_when_it_answers(tmp_path, index_that_answers):
    chosen, reason, _ = choose(tmp_path, driver=None, index=index_that_answers)
    assert chosen == index_that_answers
    assert reason == f"no NVIDIA driver found: installing the CPU build of torch from {index_that_answers}"


@linux_only
def test_without_a_driver_and_no_answer_it_falls_back_and_says_so(tmp_path):
    chosen, reason, took = choose(tmp_path, driver=None, index=REFUSED)
    assert chosen == ""
    assert reason.startswith(f"no NVIDIA driver found, but {REFUSED} did not answer: installing torch from pip's default index instead")
    assert took < 5


@linux_only
def test_an_index_that_never_answers_costs_at_most_5_seconds(tmp_path):
    with socket.socket() as silent:  # accepts connections (the backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        chosen, reason, took = choose(tmp_path, driver=None, index=f"http://127.0.0.1:{silent.getsockname()[1]}")
    assert chosen == "" and "did not answer" in reason
    assert 4 < took < 15  # about 5 s, and not pip's minutes of retries


def test_torch_index_url_overrides_the_choice(tmp_path, index_that_answers):
    for driver in ("proc", None):
        chosen, reason, _ = choose(tmp_path, driver=driver, index=index_that_answers, torch_index_url="https://example.invalid/whl/cu128")
        assert chosen == "https://example.invalid/whl/cu128"
        assert reason == "TORCH_INDEX_URL is set: installing torch from https://example.invalid/whl/cu128"


@linux_only
def test_the_real_cpu_index_gives_a_cpu_wheel(tmp_path):
    """Without a driver and with the real index: lab.sh picks it, and pip resolves a CPU wheel there (not installed)."""
    chosen, reason, _ = choose(tmp_path, driver=None, index=CPU_INDEX)
    if chosen != CPU_INDEX:
        pytest.skip(f"{CPU_INDEX} cannot be reached from this machine ({reason})")
    assert reason == f"no NVIDIA driver found: installing the CPU build of torch from {CPU_INDEX}"
    python = VENV / "bin" / "python" if (VENV / "bin" / "python").exists() else Path(shutil.which("python3"))
    # no pip configuration (a find-links folder or an extra index could offer a wheel of its own)
    env = {k: v for k, v in _env(PIP_CONFIG_FILE=os.devnull).items() if not k.startswith("PIP_") or k == "PIP_CONFIG_FILE"}
    report = tmp_path / "report.json"
    out = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                          "--report", str(report), torch_spec(), "--index-url", chosen], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["download_info"]["url"].startswith("https://download.pytorch.org/whl/cpu/")
    if platform.machine() == "x86_64":
        assert item["metadata"]["version"].endswith("+cpu")


def torch_spec() -> str:
    out = sourced('printf "%s" "$TORCH_SPEC"', env=_env())
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_new_venv_gets_the_torch_ci_tests_and_readme_names():
    """lab.sh installs one torch wherever it comes from (the CPU index, pip's default, TORCH_INDEX_URL): the
    version CI runs the suite on, inside the tested range, named in docs/clusters.md's table."""
    from lablib.doctor import TESTED, _version_tuple

    spec = torch_spec()
    assert spec.startswith("torch=="), spec
    version = spec.split("==")[1]
    first, last = TESTED["torch"]
    assert _version_tuple(first) <= _version_tuple(version)[:2] <= _version_tuple(last)
    docs = (ROOT / "docs" / "clusters.md").read_text()
    assert f"| {version}+cpu |" in docs or f"| {version} |" in docs, f"docs/clusters.md's tested versions lack torch {version}"


# --- the learner's working copy ----------------------------------------------------------------


def _notebook(text):
    return json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": [text]}], "metadata": {},
                       "nbformat": 4, "nbformat_minor": 5})


def test_new_labs_are_copied_and_edited_ones_never_overwritten(tmp_path):
    (tmp_path / "labs").mkdir()
    for name in ("00_a", "01_b"):
        (tmp_path / "labs" / f"{name}.ipynb").write_text(_notebook(f"released {name}"))
    (tmp_path / "labs" / "quiz_answers.json").write_text('{"answered": "before my-labs existed"}')
    sync = functools.partial(sourced, "sync_labs", cwd=tmp_path)

    out = sync()
    assert out.returncode == 0, out.stderr
    assert out.stderr == "lab.sh: your working copy is my-labs/ (git and ./lab.sh never overwrite it); copied 2 labs from labs/: 00_a.ipynb 01_b.ipynb\n"
    mine = tmp_path / "my-labs"
    assert sorted(p.name for p in mine.iterdir()) == ["00_a.ipynb", "01_b.ipynb", "quiz_answers.json"]
    assert (mine / "00_a.ipynb").read_text() == _notebook("released 00_a")

    # the learner works on lab 00; then `git pull` brings lab 02 and a changed lab 00
    (mine / "00_a.ipynb").write_text(_notebook("my work"))
    (tmp_path / "labs" / "00_a.ipynb").write_text(_notebook("released 00_a, second edition"))
    (tmp_path / "labs" / "02_c.ipynb").write_text(_notebook("released 02_c"))
    out = sync()
    assert out.stderr == "lab.sh: copied 1 new lab(s) from labs/ to my-labs/: 02_c.ipynb; the notebooks already there are untouched\n"
    assert (mine / "00_a.ipynb").read_text() == _notebook("my work")
    assert (mine / "02_c.ipynb").read_text() == _notebook("released 02_c")

    assert sync().stderr == "lab.sh: your labs are in my-labs/ (nothing new in labs/)\n"

    # starting a lab over: remove (or rename) the copy, and the next run brings the current release
    (mine / "00_a.ipynb").rename(mine / "00_a-first-try.ipynb")
    (mine / "quiz_answers.json").unlink()
    assert "copied 1 new lab(s) from labs/ to my-labs/: 00_a.ipynb" in sync().stderr
    assert (mine / "00_a.ipynb").read_text() == _notebook("released 00_a, second edition")
    assert (mine / "00_a-first-try.ipynb").read_text() == _notebook("my work")
    assert not (mine / "quiz_answers.json").exists()  # answers move along only when my-labs/ is made
    assert not list(mine.glob(".*.part"))


@needs_venv
def test_lab_sh_copies_the_released_labs_and_keeps_the_learners(tmp_path):
    """Through ./lab.sh itself, on the course's own labs/ (the copy happens before JupyterLab starts)."""
    mine = tmp_path / "my-labs"
    env = _env(MY_LABS=str(mine))
    out = lab_sh("--version", env=env)
    assert out.returncode == 0, out.stderr
    assert f"copied {len(LABS)} labs from labs/: {' '.join(LABS)}" in out.stderr
    assert sorted(p.name for p in mine.iterdir()) == LABS
    for name in LABS:
        assert (mine / name).read_bytes() == (ROOT / "labs" / name).read_bytes()

    edited, removed = LABS[0], LABS[-1]
    (mine / edited).write_text(_notebook("my work"))
    (mine / removed).unlink()
    out = lab_sh("--version", env=env)
    assert out.returncode == 0, out.stderr
    assert f"copied 1 new lab(s) from labs/ to {mine}/: {removed}; the notebooks already there are untouched" in out.stderr
    assert (mine / edited).read_text() == _notebook("my work")
    assert (mine / removed).read_bytes() == (ROOT / "labs" / removed).read_bytes()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a clone")
def test_the_working_copy_is_outside_version_control():
    out = subprocess.run(["git", "check-ignore", "-q", "my-labs/00_welcome.ipynb"], cwd=ROOT)
    assert out.returncode == 0, "my-labs/ must be in .gitignore, so that git pull and git status leave it alone"
