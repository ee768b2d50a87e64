"""Measuring collectives: bandwidth as nccl-tests reports it, a sweep over message sizes on the
ranks, and the α-β (latency-bandwidth) model fitted to it.

Bandwidth is reported as nccl-tests does (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = S / t for a collective on S bytes (all-gather: the gathered output; reduce-scatter: the input;
all-reduce: the tensor); busbw = algbw x (N-1)/N (all-gather, reduce-scatter) or x 2(N-1)/N
(all-reduce), comparable to the link's bandwidth whatever N is.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from . import comm

OPS = ("all_gather", "reduce_scatter", "all_reduce")
BUS_FACTOR = comm.BUS_FACTOR


def sweep_sizes() -> list[int]:
    """1 KB to 64 MB in steps of 4x; up to 4 MB when LABLIB_QUICK=1 (the test suite sets it)."""
    from .paths import quick

    top = 22 if quick() else 26
    return [1 << k for k in range(10, top + 1, 2)]


def _time(fn, iters):
    """Per-iteration times on this rank; every iteration starts together (barrier, untraced)."""
    on_gpu = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
    times = []
    for _ in range(iters):
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def _lablib() -> dict:
    """lablib's rings (lab 02's answers), imported when measured: the grading box holds no answers."""
    from .answers import lab02

    return {"all_gather": lab02.ring_all_gather, "reduce_scatter": lab02.ring_reduce_scatter,
            "all_reduce": lab02.ring_all_reduce}


def measure(size: int, iters: int = 5, ring=None, dtype=torch.float32) -> dict:
    """On every rank (inside ``cluster.run``): times of each collective on ``size`` bytes, for the ring
    (``ring``: {op: fn}, default this module's) and for torch.distributed, plus a plain memory copy."""
    from .timeline import RECORDER

    ring = ring or _lablib()
    n = dist.get_world_size()
    dev = comm.torch_device()  # the GPU under NCCL; host memory under Gloo, where the link is
    elems = max(n, size // torch.tensor([], dtype=dtype).element_size() // n * n)  # a multiple of n
    full = torch.ones(elems, dtype=dtype, device=dev)
    part = torch.ones(elems // n, dtype=dtype, device=dev)
    plain = {"all_gather": lambda: comm.all_gather_single(full, part),
             "reduce_scatter": lambda: comm.reduce_scatter_single(part, full),
             "all_reduce": lambda: dist.all_reduce(full)}
    calls = {"all_gather": lambda f: f(full, part), "reduce_scatter": lambda f: f(part, full),
             "all_reduce": lambda f: f(full)}
    spans, RECORDER.spans = RECORDER.spans, None  # a sweep is thousands of messages: do not trace them
    try:
        out = {}
        for op in OPS:
            out[(op, "ring")] = _time(lambda: calls[op](ring[op]), iters)
            out[(op, "torch")] = _time(plain[op], iters)
        dst = torch.empty_like(full)
        out[("memcpy", "torch")] = _time(lambda: dst.copy_(full), iters)
    finally:
        RECORDER.spans = spans
    return {"bytes": full.nbytes, "times": out}


RING_TASKS = {"all_gather": "Task 2.2", "reduce_scatter": "Task 2.3", "all_reduce": "Task 2.4"}


def learner_rings(**yours) -> tuple[dict, dict]:
    """({op: function}, {op: "yours" or "lablib's"}): the learner's ring for each op whose task's check
    has passed in this kernel, lablib's for the others (a ring not checked yet may be wrong or hang)."""
    from .checks import PASSED

    own = {op: fn for op, fn in yours.items() if RING_TASKS[op] in PASSED}
    lablibs = _lablib()
    return ({op: own.get(op, lablibs[op]) for op in OPS},
            {op: "yours" if op in own else "lablib's" for op in OPS})


def sweep(cluster, sizes, iters: int = 5, ring=None, progress=None, whose=None) -> list[dict]:
    """Measure every size on ``cluster``; one row per (size, op, implementation) with the time of the
    slowest rank (median over iterations), algbw and busbw in GB/s. ``whose`` ({op: label}) is kept
    on the ring's rows (default "lablib's" without ``ring``, "given" with it)."""
    rows = []
    n = cluster.world_size
    whose = whose or {op: "given" if ring else "lablib's" for op in OPS}
    for size in sizes:
        per_rank = cluster.run(measure, size, iters, ring)
        nbytes = per_rank[0]["bytes"]
        for key in per_rank[0]["times"]:
            op, impl = key
            if op == "memcpy":  # each rank copies on its own: its own time, the median over ranks
                t = statistics.median(statistics.median(r["times"][key]) for r in per_rank)
            else:  # a collective is done when its slowest rank is
                t = statistics.median(max(r["times"][key][i] for r in per_rank) for i in range(iters))
            algbw = nbytes / t / 1e9
            rows.append(dict(n=n, bytes=nbytes, op=op, impl=impl, seconds=t, algbw=algbw,
                             busbw=algbw * BUS_FACTOR[op](n), whose=whose.get(op, "") if impl == "ring" else ""))
        if progress is not None:
            progress.value += 1
    return rows


_TABLE = [("all_gather", "ring", "ring all-gather"), ("all_gather", "torch", "torch all-gather"),
          ("reduce_scatter", "ring", "ring reduce-scatter"), ("reduce_scatter", "torch", "torch reduce-scatter"),
          ("all_reduce", "ring", "ring all-reduce"), ("all_reduce", "torch", "torch all-reduce"),
          ("memcpy", "torch", "memory copy")]


def _row(rows, op, impl, n, size):
    return next(r for r in rows if (r["op"], r["impl"], r["n"], r["bytes"]) == (op, impl, n, size))


def busbw_table(rows, size: int) -> str:
    """Bus bandwidth in GB/s at ``size`` bytes: one line per implementation, one column per world size."""
    sizes = sorted({r["n"] for r in rows})
    lines = [f"{'busbw (GB/s)':24s}" + "".join(f"{f'N={n}':>8s}" for n in sizes)]
    for op, impl, label in _TABLE:
        lines.append(f"{label:24s}" + "".join(f"{_row(rows, op, impl, n, size)['busbw']:8.2f}" for n in sizes))
    return "\n".join(lines)


def slowdown(rows, size: int, n: int, op: str = "reduce_scatter") -> float:
    """torch.distributed's time over the ring's, for ``op`` on ``size`` bytes and ``n`` ranks."""
    return _row(rows, op, "torch", n, size)["seconds"] / _row(rows, op, "ring", n, size)["seconds"]


def fit_alpha_beta(rows, op: str = "all_gather", impl: str = "ring") -> tuple[float, float]:
    """Fit t = (N-1)·α + (N-1)/N · S/β to the ring's measured times (α: seconds per step, β: bytes/s),
    by least squares on relative error so small and large messages count alike."""
    pts = [(r["n"], r["bytes"], r["seconds"]) for r in rows if r["op"] == op and r["impl"] == impl]
    if len(pts) < 2:
        raise ValueError(f"need measurements of {op} ({impl}) at two sizes at least")
    # t = a·(N-1) + b·(N-1)/N·S, weights 1/t: solve the 2x2 normal equations
    xs = [((n - 1) / t, (n - 1) / n * s / t) for n, s, t in pts]
    a11 = sum(x[0] * x[0] for x in xs)
    a12 = sum(x[0] * x[1] for x in xs)
    a22 = sum(x[1] * x[1] for x in xs)
    b1, b2 = sum(x[0] for x in xs), sum(x[1] for x in xs)
    det = a11 * a22 - a12 * a12
    alpha, inv_beta = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    return alpha, 1 / inv_beta


def predict(op: str, size: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for a ring collective on ``size`` bytes over ``n`` ranks under the α-β model."""
    return comm.ring_steps(op, n) * alpha + BUS_FACTOR[op](n) * size / beta
