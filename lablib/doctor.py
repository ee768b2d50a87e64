"""``lablib doctor``: what this machine has, which backend the labs will use, and a real smoke test."""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import sys
import time

# Why the course needs each runtime dependency; the versions come from the package's own metadata
# (pyproject.toml), so they are written down once.
WHY = {
    "torch": "FSDP2 fully_shard, DTensor and torch.distributed.pipelining",
    "numpy": "torch.distributed.pipelining and all_gather_object",
    "cloudpickle": "shipping notebook functions to the ranks",
    "jupyterlab": "the notebooks",
    "ipywidgets": "quizzes and sliders",
    "plotly": "timelines and charts",
    "pyyaml": "quiz banks",
    "RestrictedPython": "grading: exercise code compiled with runtime guards",
}


# The versions the whole test suite passed on (tests/compat.sh runs it with another Python and torch):
# first and last, compared by major.minor. docs/clusters.md's "Tested versions" says the same (a test holds the
# two together), and the lower ends are pyproject.toml's minimums. `lablib doctor` warns outside them.
TESTED = {"python": ("3.10", "3.13"), "torch": ("2.8", "2.15"), "jupyterlab": ("4.6", "4.6"),
          "ipywidgets": ("8.1", "8.1")}
WARN_UNTESTED = ("python", "torch")


def untested(name: str, version: str) -> str | None:
    """The warning for a ``name`` ``version`` outside TESTED, or None inside it."""
    first, last = TESTED[name]
    if _version_tuple(first) <= _version_tuple(version)[:2] <= _version_tuple(last):
        return None
    label = "Python" if name == "python" else name
    return (f"warning: running {label} {version}, but the course was tested with {label} {first} to {last} "
            f"(see docs/clusters.md, Tested versions): it may still work")


def requirements() -> list[tuple[str, str, str]]:
    """(distribution, minimum version, why) for each runtime dependency of lablib."""
    out = []
    for spec in md.requires("lablib") or []:
        if "extra ==" in spec:
            continue
        name = re.split(r"[<>=!~\s;\[(]", spec, maxsplit=1)[0]
        minimum = re.search(r">=\s*([\w.]+)", spec)
        out.append((name, minimum.group(1) if minimum else "0", WHY.get(name, "the labs")))
    return out


def _version_tuple(v: str):
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _row(label, value, note=""):
    print(f"  {label:<16} {value}{('   ' + note) if note else ''}")


def _warn_if_untested(name, version):
    warning = untested(name, version)
    if warning:
        print(f"  {warning}")


def environment(ranks: int = 2) -> list[str]:
    """Print versions, cores, GPUs and the backend ``auto`` picks; return the problems found."""
    problems = []
    _row("python", platform.python_version(), "ok" if sys.version_info >= (3, 10) else "needs >= 3.10")
    if sys.version_info < (3, 10):
        problems.append("Python 3.10 or newer is needed")
    else:
        _warn_if_untested("python", platform.python_version())
    for dist, minimum, why in requirements():
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            _row(dist, "missing", f"needed for {why}")
            problems.append(f"{dist} is not installed (needed for {why}); run ./lab.sh, or pip install -e .")
            continue
        ok = _version_tuple(version) >= _version_tuple(minimum)
        _row(dist, version, "ok" if ok else f"needs >= {minimum} for {why}")
        if not ok:
            problems.append(f"{dist} {version} is too old: >= {minimum} is needed for {why}")
        elif dist in WARN_UNTESTED:
            _warn_if_untested(dist, version)
    _row("CPU cores", os.cpu_count())
    if any(p.startswith("torch ") for p in problems):
        return problems
    try:
        import torch
        import torch.distributed as dist

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
        _row("GPUs", f"{gpus} ({names})" if gpus else "none")
        note = cuda_build_note(torch.version.cuda, gpus)
        if note:
            print(f"  {note}")
        if not dist.is_available():
            problems.append("this torch build has no torch.distributed")
        elif not dist.is_gloo_available():
            problems.append("this torch build has no Gloo backend (needed for CPU ranks)")
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.pipelining import ScheduleGPipe  # noqa: F401
        from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: F401
    except Exception as exc:  # an import that fails is the diagnosis
        problems.append(f"torch is installed but broken: {type(exc).__name__}: {exc}")
        return problems

    from .pool import resolve_backend

    backend = resolve_backend("auto", ranks)
    _row("backend", f"auto -> {'NCCL (one GPU per rank)' if backend == 'nccl' else 'Gloo (CPU)'} for {ranks} ranks")
    return problems


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def cuda_build_note(cuda: str | None, gpus: int) -> str | None:
    """A note for a CUDA build of torch on a machine without a GPU (pip's default index installs one on
    Linux): it works, on the CPU, but takes several GB where the CPU build takes a few hundred MB."""
    if not cuda or gpus:
        return None
    return (f"note: this torch is a CUDA build (CUDA {cuda}, several GB) and this machine has no GPU: the labs run "
            f"on the CPU either way. The CPU build is a few hundred MB: rm -rf .venv && TORCH_INDEX_URL={CPU_INDEX} "
            "./lab.sh")


def doctor(ranks: int = 2) -> int:
    """``lablib doctor``: the environment, then a real all-reduce on ``ranks`` ranks. Returns an exit code."""
    print("lablib doctor")
    problems = environment(ranks)
    if not problems:
        from .pool import Cluster

        try:
            with Cluster(ranks, quiet=True, timeout=20) as c:
                t = time.perf_counter()
                values = c.run(_smoke)
                job_ms = (time.perf_counter() - t) * 1e3
                expected = float(sum(range(1, ranks + 1)))
                ok = all(abs(v - expected) < 1e-6 for v in values)
                _row("smoke test", f"{ranks}-rank all_reduce -> {values}", f"{'ok' if ok else f'expected {expected}'} "
                     f"(start {c.start_seconds:.1f} s, job {job_ms:.1f} ms)")
                if not ok:
                    problems.append(f"all_reduce returned {values}, expected {expected} on every rank")
        except Exception as exc:
            problems.append(f"the {ranks}-rank smoke test failed: {type(exc).__name__}: {exc}")
    return _verdict(problems)


def _smoke():
    import torch
    import torch.distributed as dist

    from .comm import all_reduce, device

    x = torch.tensor([float(dist.get_rank() + 1)], device=device())
    all_reduce(x)
    return x.item()


def _verdict(problems) -> int:
    if problems:
        print("\nproblems:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nall good: open the labs with ./lab.sh")
    return 0
