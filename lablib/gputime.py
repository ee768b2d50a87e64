"""Timelines timed where the GPU ran: a job's spans placed by the GPU's own records, not the host's clock.

On a GPU, the host's clock around a Python call times the launch: kernels are queued and run later, and an
NCCL collective's work completes on the host once it is enqueued. So a rank job on a GPU runs under
``torch.profiler`` (CPU and CUDA activities), with one synchronisation at its end and none per operation,
and each span the job recorded is then placed where its kernels ran:

- a span's kernels are those the host launched inside it (the launch's ``correlation`` in the profiler's
  trace ties a ``cuda_runtime``/``cuda_driver`` event to its ``kernel``, ``gpu_memcpy`` or ``gpu_memset``
  record); a communication span takes NCCL's kernels (``ncclDevKernel_*``, ``ncclKernel_*``) and copies, a
  compute span every other kernel (``_owned`` says it exactly);
- a span with kernels runs from its first kernel's start to its last kernel's end ("GPU kernels"); one
  with none keeps the host's clock ("host": a Gloo transfer of host memory, Python work); a span holding
  both (a staged Gloo collective inside one span) covers both ("GPU kernels + host").

``meta["clock"]`` says which, and the chart's lanes say it too. The profiler's clock is tied to the rank's
by a marker (``mark``); Kineto puts GPU records on the host's time base, so one marker places both.
``device_records`` and ``on_device`` are pure functions of the trace: ``tests/test_gputime.py`` checks them
on traces in the profiler's format.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from bisect import bisect_left, bisect_right
from contextlib import contextmanager
from typing import NamedTuple

LAUNCHES = ("cuda_runtime", "cuda_driver", "runtime")  # the host's calls that queue GPU work
ON_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")  # what ran on the GPU
NCCL_KERNELS = ("ncclDevKernel", "ncclKernel")
GPU, HOST, BOTH = "GPU kernels", "host", "GPU kernels + host"


# -- the profiler's trace and the rank's clock --------------------------------------------------------
MARK = "lablib.clock"  # the marker recorded at a known perf_counter_ns


def clock_offset(xs: list[dict], mark_ns: int) -> tuple[int, object]:
    """(ns to add to a trace's µs × 1000 to land on the rank's clock, the thread that recorded the marker)
    from the complete events ``xs`` of a Chrome trace."""
    mark = next((e for e in xs if e.get("name") == MARK), None)
    if mark is None:
        raise ValueError(f"the trace has no {MARK!r} marker to align its clock with")
    return mark_ns - round(mark["ts"] * 1000), mark["tid"]


def mark() -> int:
    """Record the marker that ties the profiler's clock to ``perf_counter_ns``; returns its time. The
    first ``record_function`` of a profile costs milliseconds (measured: 2.4 ms) and the marker's stamp
    falls somewhere inside its entry, so warm up first and take the middle of the entry."""
    from torch.profiler import record_function

    with record_function("lablib.warm-up"):
        pass
    before = time.perf_counter_ns()
    with record_function(MARK):
        after = time.perf_counter_ns()
    return (before + after) // 2


def events(prof) -> list[dict]:
    """The profiler's Chrome-trace events, read back from the file it exports."""
    with tempfile.TemporaryDirectory(prefix="lablib-trace-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


class Record(NamedTuple):
    """One piece of GPU work, ns on the rank's clock: when the host launched it, when it ran."""
    launched: int
    start: int
    end: int
    name: str
    nccl: bool
    copy: bool


def device_records(events: list[dict], mark_ns: int, pauses: list[tuple[int, int]] = ()) -> list[Record]:
    """The GPU work in a Chrome trace of ``torch.profiler`` (Kineto's format), each tied to its launch by
    the ``correlation`` in both records' ``args``, sorted by launch. Work whose launch the trace lacks is
    left out: no span could own it. ``pauses``: ``CLOCK.changes`` (the span clock's pauses under a simulated
    link), so the records land on the span clock."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    offset, _ = clock_offset(xs, mark_ns)
    at = [t for t, _ in pauses]

    def ns(us):
        t = round(us * 1000) + offset
        k = bisect_right(at, t)
        return t - (pauses[k - 1][1] if k else 0)

    launched = {e["args"]["correlation"]: e["ts"] for e in xs
                if str(e.get("cat", "")).lower() in LAUNCHES and "correlation" in (e.get("args") or {})}
    records = []
    for e in xs:
        cat = str(e.get("cat", "")).lower()
        corr = (e.get("args") or {}).get("correlation")
        if cat in ON_DEVICE and corr in launched:
            records.append(Record(ns(launched[corr]), ns(e["ts"]), ns(e["ts"] + e.get("dur", 0)), e["name"],
                                  e["name"].startswith(NCCL_KERNELS), "mem" in cat))
    return sorted(records)


# A collective's op -> the word NCCL's kernel for it has in its name (ncclDevKernel_AllGather_RING_LL...)
NCCL_OPS = {"all_gather": "AllGather", "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce",
            "broadcast": "Broadcast", "send": "SendRecv", "recv": "SendRecv", "all_to_all": "SendRecv"}


def _owned(s, records: list[Record]) -> list[Record]:
    """Of the GPU work launched inside span ``s``, what is its own. A compute span's: every kernel but NCCL's.
    A communication span's: NCCL's kernels (those of its op, where it names one and they are there; another
    thread may launch others meanwhile, as lablib's strict mode does) and, where it is synchronous, copies (an
    asynchronous span lasts until its work completes, and the copies launched meanwhile are other spans')."""
    if s.kind == "compute":
        return [r for r in records if not r.nccl]
    nccl = [r for r in records if r.nccl]
    word = NCCL_OPS.get(s.meta.get("op"))
    mine = [r for r in nccl if word and word in r.name] or nccl
    return mine + ([r for r in records if r.copy] if not s.is_async else [])


def on_device(spans: list, records: list[Record]) -> list:
    """``spans`` (``RawSpan``s on the rank's clock) each placed where its GPU work ran (see the module's
    docstring), with ``meta["clock"]`` set; spans of other kinds ("idle") as they are."""
    launched = [r.launched for r in records]
    placed, clocks = [], []
    for s in spans:
        inside = records[bisect_left(launched, s.t0):bisect_right(launched, s.t1)]
        # a span over a simulated link lasts what the link would take: its kernels moved the data off the clock
        mine = _owned(s, inside) if s.kind in ("compute", "comm") and "simulated" not in s.meta else []
        if mine:
            placed.append((min(r.start for r in mine), max(r.end for r in mine)))
            clocks.append(GPU)
        else:
            placed.append((s.t0, s.t1))
            clocks.append(HOST if s.kind in ("compute", "comm") else None)
    out = []
    for i, s in enumerate(spans):
        t0, t1 = placed[i]
        clock = clocks[i]
        if clock == GPU:  # what ran on the host inside it (a staged Gloo transfer) is part of it too
            inner = [placed[j] for j, c in enumerate(spans) if clocks[j] == HOST and c.depth > s.depth
                     and c.kind == s.kind and s.t0 <= c.t0 and c.t1 <= s.t1]
            if inner:
                t0, t1, clock = min([t0] + [a for a, _ in inner]), max([t1] + [b for _, b in inner]), BOTH
        out.append(s if clock is None else s._replace(t0=t0, t1=t1, meta={**s.meta, "clock": clock}))
    return out


# -- on a rank ----------------------------------------------------------------------------------------
SAVE = "LABLIB_SAVE_TRACES"  # a folder: each GPU-timed job's trace is also saved there (tests/gpu.sh)
KEEP = LAUNCHES + ON_DEVICE  # the profiler's categories of GPU work and its launches


def wanted() -> bool:
    """Whether this rank's jobs are timed on the GPU: it computes on one (or a saved trace is asked for)."""
    return os.environ.get("LABLIB_DEVICE") == "cuda" or bool(os.environ.get(SAVE))


@contextmanager
def pauses_kept():
    """Within the block, the span clock's pauses are kept (``CLOCK.changes``): the list it yields."""
    from .timeline import CLOCK

    CLOCK.changes = kept = [(0, CLOCK.paused)]
    try:
        yield kept
    finally:
        CLOCK.changes = None


def activities() -> list:
    """What the profiler records on this rank: the host's ops, and on a GPU its kernels too."""
    import torch
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if wanted() and torch.cuda.is_available() else [])


def start(prof):
    """``prof`` (a ``torch.profiler.profile``) started. Some releases (torch 2.11) warn at every start without a
    schedule that the profile "clears events at the end of each cycle": a one-off profile has one cycle, and every
    rank of every job on a GPU would print it to the learner."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        prof.start()
    return prof


@contextmanager
def profiler():
    """``with profiler() as prof``: a profile of ``activities()``, ``start``ed and stopped around the block."""
    from torch.profiler import profile

    prof = start(profile(activities=activities()))
    try:
        yield prof
    finally:
        prof.stop()


def place(spans: list, trace: list[dict], mark_ns: int, pauses: list) -> list:
    """``spans`` placed where their GPU work ran (saved first, under LABLIB_SAVE_TRACES), where this rank's
    jobs are timed on the GPU; else as they are."""
    if not wanted():
        return spans
    save(trace, mark_ns, spans, pauses)
    return on_device(spans, device_records(trace, mark_ns, pauses))


def timed_on_device(fn, args=(), kwargs=None, call=None):
    """``fn(*args, **kwargs)`` (or ``call(fn, args, kwargs)``) on this rank, its spans placed where its GPU
    work ran: under the profiler, one synchronisation at the end. As it is where the rank has no GPU (and no
    saved trace is asked for), and for ``lablib.profiled`` and ``lablib.timed``, which place their own."""
    kwargs = kwargs or {}
    call = call or (lambda fn, args, kwargs: fn(*args, **kwargs))
    if not wanted() or getattr(fn, "own_profiler", False):
        return call(fn, args, kwargs)
    from torch.profiler import profile

    from .comm import synchronize
    from .timeline import RECORDER

    prof = start(profile(activities=activities()))
    try:
        with pauses_kept() as pauses:
            mark_ns = mark()
            return call(fn, args, kwargs)
    finally:
        synchronize()
        prof.stop()
        spans = RECORDER.spans
        if spans is not None:
            try:
                spans[:] = place(spans, events(prof), mark_ns, pauses)
            except Exception as exc:  # noqa: BLE001 - the job's result matters more than its chart
                print(f"lablib: this job's spans keep the host's clock (launches, not kernels): reading the "
                      f"profiler's trace failed: {type(exc).__name__}: {exc}", file=sys.stderr)


_SAVED = [0]


def save(events: list[dict], mark_ns: int, spans: list, pauses: list = ()) -> str | None:
    """Under LABLIB_SAVE_TRACES=DIR: the job's trace, trimmed to what ``device_records`` reads of the GPU work
    launched while the job's spans ran (a step timed after warm-ups keeps only its own), its host spans and
    the span clock's pauses, as DIR/<LABLIB_TRACE_TAG>-rank<r>-<n>.json (what ``tests/test_gputime.py``
    replays)."""
    folder = os.environ.get(SAVE)
    if not folder or not spans:  # (the pool's own jobs record nothing)
        return None
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    offset, _ = clock_offset(xs, mark_ns)
    lo, hi = (min(s.t0 for s in spans) - offset) / 1000, (max(s.t1 for s in spans) - offset) / 1000
    launches = [e for e in xs if str(e.get("cat", "")).lower() in LAUNCHES and lo <= e["ts"] <= hi]
    inside = {(e.get("args") or {}).get("correlation") for e in launches}
    ran = [e for e in xs if str(e.get("cat", "")).lower() in ON_DEVICE
           and (e.get("args") or {}).get("correlation") in inside]
    kept = [e for e in xs if e.get("name") == MARK] + launches + ran
    for e in kept:  # what device_records reads; kernels' grid, registers... are kilobytes of noise
        e["args"] = {k: v for k, v in (e.get("args") or {}).items() if k in ("correlation", "stream", "device")}
    _SAVED[0] += 1
    path = os.path.join(folder, f"{os.environ.get('LABLIB_TRACE_TAG', 'job')}-rank{os.environ.get('LABLIB_RANK', 0)}"
                                f"-{_SAVED[0]}.json")
    with open(path, "w") as f:
        json.dump({"mark_ns": mark_ns, "pauses": list(pauses), "spans": [list(s) for s in spans],
                   "traceEvents": kept}, f, default=str)
    return path
