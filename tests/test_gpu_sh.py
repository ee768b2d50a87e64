"""``tests/gpu.sh``, the check a GPU machine runs, run here with ``--dry`` (the same logic on the CPU), so it
cannot rot between GPU runs: its parts, its summary, its traces, its notebooks, its time budget and its stop."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lablib import Timeline

ROOT = Path(__file__).resolve().parents[1]


def _gpu_sh(tmp_path, *args, **env):
    out = tmp_path / "out"
    done = subprocess.run(["bash", "tests/gpu.sh", "--dry", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "GPU_PY": sys.executable, "GPU_OUT": str(out), **env})
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    return done, summary, out


def test_the_dry_run_runs_every_part_and_leaves_traces_the_fixtures_replay(tmp_path):
    done, summary, out = _gpu_sh(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr + summary
    for name in ("versions", "traces", "fixtures", "gpu-tests", "notebooks", "bench"):
        assert f"- {name}: passed" in summary, summary
    assert "dry run on the CPU" in summary and "torch " in summary and "device: cpu" in summary
    assert "sources/00_welcome: passed" in summary and "1 of 1 notebooks passed" in summary
    title = Timeline.load(out / "timeline-lab03.json").title
    assert title.startswith("lab 03's prefetching step (depth 1), 2 ranks on the CPU"), title
    traces = sorted((out / "traces").iterdir())
    assert 1 <= len(traces) <= 8 and all(t.stat().st_size < 400_000 for t in traces)
    assert {t.name.split("-rank")[0] for t in traces} == {"lab03-prefetch", "lab05-1f1b"}
    fixtures = (out / "logs" / "fixtures.log").read_text()
    # tests/test_gputime.py's tests of the hand-written fixture (all but the one that replays each trace), and one
    # per trace
    hand_written = (ROOT / "tests" / "test_gputime.py").read_text().count("\ndef test_") - 1
    assert f"{len(traces) + hand_written} passed" in fixtures, fixtures


def test_only_one_part_runs_again(tmp_path):
    done, summary, _ = _gpu_sh(tmp_path, "--only", "versions")
    assert done.returncode == 0 and "- versions: passed" in summary and "traces" not in summary


def test_parts_past_the_budget_are_left_out_and_said_so(tmp_path):
    done, summary, _ = _gpu_sh(tmp_path, GPU_BUDGET_S="0")
    assert done.returncode == 3
    assert summary.count("not run: ") == 6 and "passed" not in summary


def test_a_part_still_running_at_the_stop_is_stopped(tmp_path):
    done, summary, _ = _gpu_sh(tmp_path, "--only", "traces", GPU_STOP_S="2")
    assert done.returncode == 1 and "- traces: STOPPED at 2 s into the check" in summary, summary


def test_a_notebook_that_fails_is_named_with_its_log(tmp_path):
    """The learner's untouched copy of lab 00: its check fails under nbval."""
    done, summary, out = _gpu_sh(tmp_path, "--only", "notebooks",
                                 GPU_NOTEBOOKS="labs/00_welcome.ipynb sources/00_welcome.ipynb")
    assert done.returncode == 1 and "- notebooks: FAILED (exit 1)" in summary, summary
    assert "labs/00_welcome: FAILED (exit 1)" in summary and "sources/00_welcome: passed" in summary
    assert "1 of 2 notebooks passed" in summary
    assert " failed" in (out / "logs" / "notebooks" / "labs-00_welcome.log").read_text()


@pytest.mark.parametrize("args", [["--only", "nothing"], ["--bogus"], ["--offline", "no-such-folder"]])
def test_bad_usage_says_what_is_allowed(tmp_path, args):
    done, _, _ = _gpu_sh(tmp_path, *args)
    assert done.returncode == 2 and "usage: bash tests/gpu.sh" in done.stderr and "versions traces" in done.stderr


def test_rerunning_the_fixtures_part_replays_the_traces_captured_before(tmp_path):
    done, _, out = _gpu_sh(tmp_path, "--only", "traces")
    traces = sorted(p.name for p in (out / "traces").iterdir())
    done, summary, _ = _gpu_sh(tmp_path, "--only", "fixtures")
    assert done.returncode == 0 and "- fixtures: passed" in summary
    assert sorted(p.name for p in (out / "traces").iterdir()) == traces and traces
