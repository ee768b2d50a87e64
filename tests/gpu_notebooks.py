"""Source notebooks under nbval, a few at a time: ``tests/gpu.sh``'s notebooks part.

    python tests/gpu_notebooks.py LOGDIR NOTEBOOK... [--jobs N]

Each notebook runs as the suite runs it (pytest's nbval with the options and settings of pyproject.toml and
the root conftest.py: LABLIB_QUICK=1, LABLIB_STRICT=1), with an answers file of its own (two kernels writing
one would race), its output in LOGDIR (sources-00_welcome.log for sources/00_welcome.ipynb). Where a machine has fewer GPUs than a notebook's ranks, the
ranks share the GPUs for compute and talk over Gloo (``lablib.cluster`` decides). It prints a line per
notebook as it ends, then every notebook's in order and how many passed, and exits 1 when one did not.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(notebook: Path, logs: Path, answers: Path) -> str:
    t = time.monotonic()
    name = str(notebook.relative_to(ROOT).with_suffix("")) if notebook.is_relative_to(ROOT) else notebook.stem
    log = logs / f"{name.replace('/', '-')}.log"
    env = {**os.environ, "LABLIB_ANSWERS": str(answers / f"{name.replace('/', '-')}.json")}
    with open(log, "w") as out:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "nbval.plugin", "-p", "pytest_timeout",
                              str(notebook)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
    counts = re.sub(r"=+", "", tail[0]).strip()
    verdict = "passed" if rc == 0 else f"FAILED (exit {rc})"
    line = f"{name}: {verdict} in {time.monotonic() - t:.0f} s ({counts})"
    print(line, flush=True)
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs")
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args(argv)
    missing = [str(nb) for nb in args.notebooks if not nb.is_file()]
    if missing or args.jobs < 1:
        parser.error(f"no such notebook: {', '.join(missing)}" if missing else "--jobs must be at least 1")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lablib-answers-") as answers, ThreadPoolExecutor(args.jobs) as pool:
        lines = list(pool.map(lambda nb: run(nb.resolve(), logs, Path(answers)), args.notebooks))
    passed = sum(": passed" in line for line in lines)
    print("\n".join(["", *lines, f"{passed} of {len(lines)} notebooks passed"]))
    return 0 if passed == len(lines) else 1


if __name__ == "__main__":
    sys.exit(main())
