"""A learner's session in a real browser: JupyterLab served on loopback, Chromium driven by Playwright.

Runs the welcome lab (solved), answers a quiz question, sees the feedback, restarts the kernel, runs
everything again and sees the answer restored. Skipped when no Chromium is installed, unless
LABLIB_REQUIRE_BROWSER=1 (as in CI), where a missing browser is a failure."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from render import CHROMIUM, require_chromium

from lablib.course.notebook import SOURCE_ONLY

ROOT = Path(__file__).resolve().parents[1]
require_chromium()
playwright = pytest.importorskip("playwright.sync_api")

TOKEN = "lablib-browser-test"
ANSWER = "Both ranks compute on the GPU, taking turns on it"  # welcome/backend's right choice, whatever its letter


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    work, settings = root / "work", root / "settings"
    work.mkdir()
    # The solved lab as a learner who finished the exercise would have it.
    nb = nbformat.read(ROOT / "sources" / "00_welcome.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if SOURCE_ONLY not in c.metadata.get("tags", [])]
    nbformat.write(nb, work / "00_welcome.ipynb")
    for plugin, values in {"apputils-extension/notification": {"fetchNews": "false"},
                           "notebook-extension/tracker": {"windowingMode": "none"}}.items():
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = _free_port()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(root / "ws")}
    env.pop("LABLIB_ANSWERS", None)
    server = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
                               "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={TOKEN}",
                               f"--ServerApp.root_dir={work}"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("JupyterLab did not start within 60 s")
            time.sleep(0.3)
    try:
        yield url, work
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)


def _run_all_and_wait(page, score_text, restart=False):
    first = page.locator(".jp-CodeCell .jp-InputPrompt").first
    for attempt in range(2):  # a Run All sent while JupyterLab is still connecting the kernel can be lost
        page.click("text=Kernel" if restart else "text=Run", timeout=30_000)
        page.click("text=Restart Kernel and Run All Cells…" if restart else "text=Run All Cells")
        if restart:
            page.click(".jp-Dialog button.jp-mod-accept")
            break  # the cells keep their counts from the run before: the score says whether it ran
        try:  # the first cell got an execution count ("[1]:"), or is running ("[*]:")
            page.wait_for_function("el => /\\[(\\*|\\d+)\\]/.test(el.textContent)", arg=first.element_handle(),
                                   timeout=60_000)
            break
        except playwright.TimeoutError:
            if attempt:
                raise
            print("browser test: Run All did not start the cells; sent again")
    page.wait_for_selector(f"text={score_text}", timeout=180_000)


def test_answer_survives_a_kernel_restart_in_a_real_browser(lab, tmp_path):
    url, work = lab
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/00_welcome.ipynb?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook", timeout=60_000)
            page.wait_for_selector("#jp-main-statusbar >> text=Idle", timeout=60_000)
            _run_all_and_wait(page, "00_welcome: 0/6 correct")
            question = page.locator(".lablib-question").filter(has_text="A machine has one GPU").first
            question.locator("label", has_text=ANSWER).click()
            question.locator("button", has_text="Check").click()
            question.locator("text=✓ Correct.").wait_for(timeout=10_000)
            assert "attempts: 1" in question.inner_text()
            answers = json.loads((work / "quiz_answers.json").read_text())["answers"]
            assert answers["welcome/backend"]["response"] == [1]

            _run_all_and_wait(page, "00_welcome: 1/6 correct", restart=True)
            question = page.locator(".lablib-question").filter(has_text="A machine has one GPU").first
            question.locator("text=Your saved answer.").wait_for(timeout=10_000)
            assert "✓ Correct." in question.inner_text()
            assert question.locator("input[type=radio]").nth(1).is_checked()
        except Exception:
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()
