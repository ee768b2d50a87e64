"""Every performance claim of the course, measured side by side in one run, as one table.

    python -m lablib.bench [--quick] [--json FILE] [--only P1,P3] [--readme]      (or ./lab.sh bench ...)

Per claim: the course's number and its anchor's, measured in the same run, their ratio, median and
min-max over repetitions, and the target. ``--quick`` (about a minute on 2 cores) leaves out the
whole-course runs (P2, P8); the full run takes about 8 minutes. With a GPU per rank it measures NCCL.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .paths import ROOT


@dataclass
class Row:
    item: str
    measure: str
    unit: str
    ours: list = field(default_factory=list)       # the course's number, every repetition
    anchor: list = field(default_factory=list)     # what it is compared with, same run
    anchor_name: str = ""
    target: str = ""
    met: bool | None = None                        # None: no target, or not measured
    note: str = ""

    @property
    def ratio(self) -> float | None:
        ok = self.ours and self.anchor and statistics.median(self.anchor)
        return statistics.median(self.ours) / statistics.median(self.anchor) if ok else None


@dataclass
class Settings:
    quick: bool
    reps: int
    backend: str = "auto"


# -- the jobs that run on the ranks ------------------------------------------------------------------
def trivial():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    dist.all_reduce(x)
    return x[0].item()


def raise_on_rank0():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(4))


def stuck_on_rank0():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.all_reduce(torch.ones(4))


def training_steps(steps: int, traced: bool, width: int = 512, layers: int = 4, batch: int = 64) -> float:
    """Median seconds of a data-parallel MLP step, with lablib's spans and traced collectives or without."""
    import torch
    import torch.distributed as dist

    from . import comm
    from .timeline import span

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(batch, width)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        h = x
        for i, layer in enumerate(model):
            with span(f"fwd L{i}") if traced else contextlib.nullcontext():
                h = torch.relu(layer(h))
        with span("bwd") if traced else contextlib.nullcontext():
            h.square().mean().backward()
        for p in model.parameters():
            comm.all_reduce(p.grad, name="grad all_reduce") if traced else dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _spawn_target(rank, world_size, port):
    import torch.distributed as dist

    # torch 2.8's Gloo writes "[Gloo] Rank N is connected to ..." to fd 1 from C++; the anchor's ranks
    # share our stdout, so their lines would land inside the table
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    trivial()
    dist.destroy_process_group()


def spawn_per_cell(world_size: int) -> float:
    """What the pool replaces: torch.multiprocessing.spawn of fresh ranks for one small job."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    mp.spawn(_spawn_target, args=(world_size, port), nprocs=world_size)
    return time.perf_counter() - t


def _timed(fn, repeat) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


# -- the items ---------------------------------------------------------------------------------------
def p1_pool(s: Settings) -> list[Row]:
    from .pool import Cluster

    rows = []
    jobs = 50 if s.quick else 200
    for n in (2, 4):
        starts, spawns = [], []
        for _ in range(s.reps):
            c = Cluster(n, backend=s.backend, timeout=10, quiet=True)
            starts.append(c.start_seconds)
            c.close()
            spawns.append(spawn_per_cell(n))
        with Cluster(n, backend=s.backend, timeout=10, quiet=True) as c:
            for _ in range(10):
                c.run(trivial)
            job = [statistics.median(_timed(lambda: c.run(trivial), jobs)) * 1e3 for _ in range(s.reps)]
        four = n == 4  # the targets are set at 4 ranks
        rows.append(Row("P1", f"a small all-reduce job, {n} ranks", "ms", job, [x * 1e3 for x in spawns],
                        "mp.spawn per cell", "<= 10 ms at 4 ranks" * four,
                        statistics.median(job) <= 10 if four else None))
        rows.append(Row("P1", f"first start of the pool, {n} ranks", "s", starts, spawns, "mp.spawn per cell",
                        "<= 5 s at 4 ranks" * four, statistics.median(starts) <= 5 if four else None))
    return rows


def _course_seconds() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "sources"], cwd=ROOT,
                   check=True, capture_output=True, env={**os.environ, "LABLIB_QUICK": "1"})
    return time.perf_counter() - t


def p2_course(s: Settings) -> list[Row]:
    return [Row("P2", "the whole course under nbval (sources/, LABLIB_QUICK=1)", "s", [_course_seconds()],
                target="", note="once")]


def p3_collectives(s: Settings) -> list[Row]:
    from . import bandwidth
    from .pool import Cluster

    size = 16 << 20
    rows = []
    for n in (2, 4):
        runs = []
        with Cluster(n, backend=s.backend, timeout=120, quiet=True) as c:
            for _ in range(s.reps):
                runs.append(bandwidth.sweep(c, [size], iters=3 if s.quick else 5))

        def busbw(op, impl):
            return [next(r["busbw"] for r in rows_ if (r["op"], r["impl"]) == (op, impl)) for rows_ in runs]

        for op in bandwidth.OPS:
            rows.append(Row("P3", f"ring {op.replace('_', '-')} busbw, 16 MiB, {n} ranks", "GB/s", busbw(op, "ring"),
                            busbw(op, "torch"), "torch.distributed (Gloo or NCCL)"))
        rows.append(Row("P3", f"ring all-gather busbw vs a memory copy, 16 MiB, {n} ranks", "GB/s",
                        busbw("all_gather", "ring"), busbw("memcpy", "torch"), "memory copy (one rank)"))
    return rows


def _side_by_side(s: Settings, n: int, ours, theirs) -> tuple[list, list]:
    """``ours(cluster)`` and ``theirs(cluster)`` on one pool of ``n`` ranks, ``s.reps`` times each,
    interleaved, so drift in the machine's load hits both alike."""
    from .pool import Cluster

    a, b = [], []
    with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps):
            a.append(ours(c))
            b.append(theirs(c))
    return a, b


def p4_fsdp(s: Settings) -> list[Row]:
    from .strategies import prefetch

    rows = []
    for n in (2, 4):
        ours, theirs = _side_by_side(
            s, n, lambda c: prefetch.step_seconds(c.run(prefetch.train, prefetch.PREFETCH, "wide8", 3, depth=1,
                                                        warmup=1)) * 1e3,
            lambda c: prefetch.step_seconds(c.run(prefetch.fsdp2_train, "wide8", 3, 1, 1)) * 1e3)
        row = Row("P4", f"FSDP step with prefetch (lab 03's solution), wide8, {n} ranks", "ms", ours, theirs,
                  "FSDP2 fully_shard, depth 1", "<= 1.25 x")
        row.met = row.ratio <= 1.25
        rows.append(row)
    return rows


def p5_hidden(s: Settings) -> list[Row]:
    from . import comm
    from .strategies import prefetch

    link = comm.LINKS["2.5GbE"]
    rows = []
    for n in (2, 4):
        sim, real = _side_by_side(s, n, lambda c: prefetch.measure(c, prefetch.PREFETCH, 1, link, steps=3)["hidden"] * 100,
                                  lambda c: prefetch.measure(c, prefetch.PREFETCH, 1, None, steps=3)["hidden"] * 100)
        row = Row("P5", f"communication hidden under compute, prefetch depth 1, wide8, {n} ranks, simulated "
                  f"{link.name}", "%", sim, real, "the same on raw Gloo (measured)", ">= 80 % (simulated link)")
        row.met = statistics.median(sim) >= 80
        rows.append(row)
    return rows


def p9_tensor(s: Settings) -> list[Row]:
    from .strategies import tensor_parallel as tp
    from .strategies import tp_reference as ref
    from .strategies.prefetch import step_seconds

    rows = []
    for n in (2, 4):
        ours, theirs = _side_by_side(s, n, lambda c: step_seconds(c.run(tp.block_job, tp.Fns(), 3)) * 1e3,
                                     lambda c: step_seconds(c.run(ref.dtensor_block_job, 3)) * 1e3)
        row = Row("P9", f"tensor-parallel block forward+backward (lab 04's solution), width 256, 512 tokens, {n} ranks",
                  "ms", ours, theirs, "DTensor Colwise/RowwiseParallel, same block", "<= 1.2 x")
        row.met = row.ratio <= 1.2
        rows.append(row)
    return rows


def p6_pipeline(s: Settings) -> list[Row]:
    """Lab 05: lablib's executor running 1F1B against PyTorch's ``Schedule1F1B`` on the same model (real
    compute, 2 ranks); then the measured bubble of every schedule against the papers' formula, over m,
    at 2 ranks with real compute and at 4 with simulated compute (its step's breakdown, views.pipeline)."""
    from .checks.lab05 import yours
    from .strategies import pipeline as pp
    from .strategies import schedules as sc
    from .strategies import pp_reference as ref
    from .views import pipeline as view

    m = 8
    one_f_one_b = lambda p, m, v=1: sc.one_f_one_b(p, m)  # noqa: E731
    ours, theirs = _side_by_side(
        s, 2, lambda c: statistics.median(c.run(ref.step_job, pp.execute, one_f_one_b, m, 1, None, 3)[0]["seconds"]) * 1e3,
        lambda c: statistics.median(c.run(ref.torch_step_job, "1f1b", m)[0]) * 1e3)
    row = Row("P6", f"1F1B step (lab 05's executor), 8 blocks of width {ref.REAL['width']}, m={m} micro-batches of "
              f"{ref.REAL['rows_per_mb']} rows, 2 ranks", "ms", ours, theirs, "torch.distributed.pipelining Schedule1F1B",
              "<= 1.2 x")
    row.met = row.ratio <= 1.2
    rows = [row]
    with contextlib.redirect_stdout(io.StringIO()):
        fns = yours()
    from .pool import Cluster

    for p, cost in ((2, None), (4, 0.005 if s.quick else 0.01)):
        with Cluster(p, backend=s.backend, timeout=60, quiet=True) as c:
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
                ms = [k for k in ((2, 8) if s.quick else (1, 2, 4, 8, 16))
                      if (name != "interleaved" or k % p == 0) and (name != "zb-h1" or k >= p)]
                runs = []
                for k in ms:
                    got = [view.measure(c, fns, name, k, v, cost) for _ in range(1 if s.quick else 3)]
                    runs.append((k, statistics.median(r["bubble"] for r in got), got[0]["theory"]))
                errors = [b - t for _, b, t in runs]
                rows.append(Row("P6", f"bubble, measured - theory, {view.TITLES[name]}{f' v={v}' if v > 1 else ''}, {p} ranks, "
                                f"{'real' if cost is None else f'simulated ({cost * 1e3:g} ms per block)'} compute",
                                "", errors, target="within +-0.05", met=max(abs(e) for e in errors) <= 0.05,
                                note="; ".join(f"m={k}: {b:.3f} vs {t:.3f}" for k, b, t in runs)))
    return rows


def p7_tracing(s: Settings) -> list[Row]:
    from .pool import Cluster

    steps = 20 if s.quick else 60
    rows = []
    for n in (2, 4):
        plain, traced = [], []
        with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
            for _ in range(s.reps + 1):  # interleaved, so drift in machine load hits both alike
                plain.append(max(c.run(training_steps, steps, False)) * 1e3)
                traced.append(max(c.run(training_steps, steps, True)) * 1e3)
        row = Row("P7", f"DP training step, traced, {n} ranks", "ms", traced, plain, "the same step untraced",
                  "<= 1.05 x")
        row.met = row.ratio <= 1.05
        rows.append(row)
    return rows


def p8_grading(s: Settings, course: list[float] | None = None) -> list[Row]:
    import nbformat

    from . import quiz
    from .course.key import solve
    from .course.notebook import SOURCE_ONLY

    with tempfile.TemporaryDirectory(prefix="lablib-bench-") as tmp:
        learner = Path(tmp) / "subs" / "learner"
        learner.mkdir(parents=True)
        for src in sorted((ROOT / "sources").glob("*.ipynb")):
            nb = nbformat.read(src, as_version=4)
            nb.cells = [c for c in nb.cells if SOURCE_ONLY not in c.metadata.get("tags", [])]
            nbformat.write(nb, learner / src.name)
            solve(src.stem, quiz.AnswerStore(learner / "quiz_answers.json"))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lablib", "grade", str(Path(tmp) / "subs"), "--source", "sources",
                        "--out", str(Path(tmp) / "gradebook.csv")], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "LABLIB_QUICK": "1"})
        graded = time.perf_counter() - t
    row = Row("P8", "grading one fully solved learner (lablib grade)", "s", [graded], course or [_course_seconds()],
              "running the course once (P2)", "<= 1.2 x", note="once")
    row.met = row.ratio <= 1.2
    return [row]


def failures(s: Settings) -> list[Row]:
    from .pool import Cluster, RankError

    def expect_error(c, fn):
        try:
            c.run(fn)
        except RankError:
            return
        raise AssertionError("expected a RankError")

    rows = []
    for n in (2, 4):
        with Cluster(n, backend=s.backend, timeout=2, quiet=True) as c:
            error = _timed(lambda: expect_error(c, raise_on_rank0), 3 * s.reps)
            hang = _timed(lambda: expect_error(c, stuck_on_rank0), s.reps)

            def stop():
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
                t0 = time.perf_counter()
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        c.run(stuck_on_rank0)
                except KeyboardInterrupt:
                    return time.perf_counter() - t0 - 0.5
                raise AssertionError("expected KeyboardInterrupt")

            stops = [stop() for _ in range(s.reps)]
            c.run(trivial)
        rows += [Row("F", f"a rank's exception back in the cell, {n} ranks", "s", error, target="<= 1 s",
                     met=max(error) <= 1),
                 Row("F", f"a hang reported, timeout=2 s, {n} ranks", "s", hang, target="<= timeout + 2 s",
                     met=max(hang) <= 4),
                 Row("F", f"stop button to every rank stopped, {n} ranks", "s", stops, target="<= 2 s",
                     met=max(stops) <= 2)]
    return rows


ITEMS = {"P1": p1_pool, "P2": p2_course, "P3": p3_collectives, "P4": p4_fsdp, "P5": p5_hidden, "P6": p6_pipeline,
         "P7": p7_tracing,
         "P8": p8_grading, "P9": p9_tensor, "F": failures}
WHOLE_COURSE = ("P2", "P8")


# -- running and printing ----------------------------------------------------------------------------
def _progress(done: int, total: int, what: str):
    print(f"\r[{'#' * done}{'-' * (total - done)}] {done}/{total} {what:<60}", end="" if done < total else "\n",
          file=sys.stderr, flush=True)


def run(only=None, quick=False, reps=None, backend="auto") -> dict:
    s = Settings(quick, reps or (2 if quick else 5), backend)
    chosen = [k for k in ITEMS if (only is None or k in only) and not (quick and k in WHOLE_COURSE)]
    rows: list[Row] = []
    course = None
    for i, key in enumerate(chosen):
        _progress(i, len(chosen), f"{key}: {ITEMS[key].__name__}")
        got = ITEMS[key](s, course) if key == "P8" else ITEMS[key](s)
        if key == "P2":
            course = got[0].ours
        rows += got
    _progress(len(chosen), len(chosen), "done")
    for key in ITEMS:
        if key not in chosen:
            why = "left out by --quick (a whole-course run)" if quick and key in WHOLE_COURSE else "not run (--only)"
            rows.append(Row(key, ITEMS[key].__name__, "", note=why))
    order = ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9", "F"]
    rows.sort(key=lambda r: order.index(r.item))
    return {"machine": machine(backend), "quick": quick, "reps": s.reps, "rows": rows}


def machine(backend="auto") -> dict:
    import torch

    from .pool import resolve_backend

    return {"cores": os.cpu_count(), "backend": resolve_backend(backend, 2), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(terse=True),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "date": time.strftime("%Y-%m-%d")}


def _cell(values) -> str:
    if not values:
        return ""
    med = statistics.median(values)
    spread = f" ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else ""
    return f"{med:.3g}{spread}"


def table(result: dict) -> str:
    """The result as a Markdown table, machine first."""
    m = result["machine"]
    head = (f"{m['date']}: {m['cores']} cores, {m['gpus']} GPU(s), backend {m['backend']}, torch {m['torch']}, "
            f"Python {m['python']}; {'--quick, ' if result['quick'] else ''}median (min-max) of {result['reps']} "
            "repetitions unless noted")
    lines = [head, "", "| item | measure | unit | course | anchor | ratio | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if not r.ours:
            lines.append(f"| {r.item} | {r.measure} | | {r.note} | | | | |")
            continue
        course = _cell(r.ours) + (f"; {r.note}" if r.note else "")
        anchor = f"{_cell(r.anchor)} {r.anchor_name}".strip() if r.anchor else ""
        ratio = f"{r.ratio:.3g}" if r.ratio is not None else ""
        met = {True: "yes", False: "NO", None: ""}[r.met]
        lines.append(f"| {r.item} | {r.measure} | {r.unit} | {course} | {anchor} | {ratio} | {r.target} | {met} |")
    return "\n".join(lines)


README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def write_readme(text: str, readme: Path = ROOT / "README.md") -> None:
    body = readme.read_text()
    if README_START not in body or README_END not in body:
        raise SystemExit(f"{readme}: no {README_START} ... {README_END} section to write the table into")
    new = re.sub(re.escape(README_START) + ".*?" + re.escape(README_END),
                 lambda _: f"{README_START}\n{text}\n{README_END}", body, flags=re.S)
    readme.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lablib.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="under 3 minutes: no whole-course runs, fewer repetitions")
    ap.add_argument("--only", help=f"comma-separated items among {', '.join(ITEMS)}")
    ap.add_argument("--reps", type=int, help="repetitions per measure (default 5, 2 with --quick)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--readme", action="store_true", help="write the table into README.md's performance section")
    ap.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    args = ap.parse_args(argv)
    only = None
    if args.only:
        only = [k.strip() for k in args.only.split(",")]
        unknown = [k for k in only if k not in ITEMS]
        if unknown:
            ap.error(f"unknown item(s) {', '.join(unknown)}: choose from {', '.join(ITEMS)}")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    result = run(only, args.quick, args.reps, args.backend)
    text = table(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "rows": [asdict(r) | {"ratio": r.ratio}
                                                                   for r in result["rows"]]}, indent=1))
    if args.readme:
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
