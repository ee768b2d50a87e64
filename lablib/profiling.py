"""PyTorch's own view of a job: run a function under ``torch.profiler`` on every rank and record what
the profiler saw as timeline spans, so it draws in the same lanes and colours as the learner's own.

    cluster.run(lablib.profiled, fsdp2_step)      # FSDP2, as torch.profiler saw it
    cluster.timeline()                            # compute lane: top-level ops; comm lane: gloo/nccl work

What becomes a span:
- compute: each top-level event of the rank's main thread (an op or a ``record_function`` range such
  as FSDP2's ``FSDP::pre_forward (0)``), named as the profiler names it, except waits on a collective
  (``wait_tensor``): that time is the rank blocked on communication, not computing;
- comm: each event of the backend's own threads (``gloo:all_gather``...), the time data was moving.
  Its op comes from the ``c10d::`` call that issued it, matched in order: under Gloo, FSDP2's
  reduce-scatter runs as ``gloo:all_reduce``, but it was issued as ``c10d::_reduce_scatter_base_``.
The profiler's clock is tied to the rank's own by a marker recorded at a known ``perf_counter_ns``.

``timed`` keeps lablib's own spans and asks the profiler only one thing: when the backend's threads
really ran each collective. Gloo runs collectives on two worker threads, first come first served, so
an asynchronous collective issued behind others waits in a queue before it runs; its span (issue to
completion) says nothing about that. ``timed`` marks each traced collective's span with the moment
its work began (``Span.runs_from``), and the timeline draws the time before it as queued, apart from
the time the data was moving.
"""
from __future__ import annotations

import math

from .gputime import MARK, activities, clock_offset, events as _events, mark as _mark, place  # noqa: F401 (MARK)
from .timeline import RECORDER, RawSpan

# c10d's names for what it issues -> the timeline's ops
C10D_OPS = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
            "broadcast": "broadcast", "alltoall": "all_to_all", "barrier": "barrier", "send": "send", "recv": "recv"}
BACKEND_PREFIXES = ("gloo:", "nccl:")
STEPS = ("lablib.steps-begin", "lablib.steps-end")  # the markers ``steps_begin`` and ``steps_end`` record

def _c10d_op(name: str) -> str | None:
    if not name.startswith("c10d::"):
        return None
    key = name[len("c10d::"):].lstrip("_").replace("_base", "").replace("_tensor", "").replace("_coalesced", "")
    return next((op for prefix, op in C10D_OPS.items() if key.startswith(prefix)), None)


def _minus(interval, holes):
    """``interval`` with the ``holes`` cut out, as a list of pieces."""
    pieces, (a, b) = [], interval
    for h0, h1 in sorted(holes):
        if h1 <= a or h0 >= b:
            continue
        if h0 > a:
            pieces.append((a, h0))
        a = max(a, h1)
    if a < b:
        pieces.append((a, b))
    return pieces


def spans_from_trace(events: list[dict], mark_ns: int) -> list[RawSpan]:
    """Spans on this rank's ``perf_counter_ns`` clock from a Chrome trace's events (see module docstring)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    offset, main = clock_offset(xs, mark_ns)

    def ns(us):
        return round(us * 1000) + offset

    issued = [op for e in sorted(xs, key=lambda e: e["ts"]) if e["tid"] == main for op in [_c10d_op(e["name"])] if op]
    comm = sorted((e for e in xs if e["name"].startswith(BACKEND_PREFIXES)), key=lambda e: e["ts"])
    spans = []
    for k, e in enumerate(comm):
        fallback = e["name"].split(":", 1)[1]
        op = issued[k] if len(issued) == len(comm) else C10D_OPS.get(fallback.replace("_", ""), fallback)
        spans.append(RawSpan(e["name"], "comm", ns(e["ts"]), ns(e["ts"] + e["dur"]), 0, None, True,
                             {"op": op, "source": "torch.profiler"}))
    mine = sorted((e for e in xs if e["tid"] == main and not e["name"].startswith("lablib.")  # lablib's markers
                   and not _c10d_op(e["name"])), key=lambda e: (e["ts"], -e["dur"]))
    # Waits on a collective, at any depth: the rank is blocked on communication there, not computing.
    waits = [(e["ts"], e["ts"] + e["dur"]) for e in mine if "wait" in e["name"].split("::")[-1]]
    end = 0.0
    for e in mine:
        if e["ts"] < end:
            continue  # inside the previous top-level event
        end = e["ts"] + e["dur"]
        for a, b in _minus((e["ts"], end), waits):
            spans.append(RawSpan(e["name"], "compute", ns(a), ns(b), 0, None, False, {"source": "torch.profiler"}))
    return spans


def backend_runs(events: list[dict], mark_ns: int) -> list[tuple[int, int, int, str]]:
    """(issued, began, ended, op), ns on the rank's clock, for each collective the main thread issued and a
    backend thread ran: the k-th ``c10d::`` call with the k-th backend event (their queue is first come,
    first served). Point-to-point calls run on the issuing thread and are left out. Empty when the two
    lists disagree in length (a call the profiler saw only half of)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    offset, main = clock_offset(xs, mark_ns)
    calls = sorted((e["ts"], _c10d_op(e["name"])) for e in xs
                   if e["tid"] == main and _c10d_op(e["name"]) not in (None, "send", "recv"))
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs
                  if e["tid"] != main and e["name"].startswith(BACKEND_PREFIXES))
    if len(calls) != len(runs):
        return []
    return [(round(c * 1000) + offset, round(a * 1000) + offset, round(b * 1000) + offset, op)
            for (c, op), (a, b) in zip(calls, runs)]


# A span's op -> the c10d calls that can carry it (Gloo's asynchronous reduce-scatter is an all-reduce:
# work._GlooAsyncReduceScatter).
_CARRIES = {"reduce_scatter": ("reduce_scatter", "all_reduce")}
SLACK_NS = 500_000  # how far the profiler's clock may sit from the rank's after the marker (measured: ~0.2 ms)


def mark_runs(spans: list, runs: list[tuple[int, int, int, str]]) -> list:
    """``spans`` with each traced collective's ``meta["ran_ns"]`` set from ``runs``: a span's call is the
    first one of its op not taken yet, issued between the span's start (less the clocks' slack) and its
    end (lablib opens a span just before calling)."""
    taken, marked = set(), {}
    for i in sorted(range(len(spans)), key=lambda i: spans[i].t0):
        s = spans[i]
        op = s.meta.get("op")
        if s.kind != "comm" or op in (None, "send", "recv") or "simulated" in s.meta:
            continue
        ops = _CARRIES.get(op, (op,))
        for k, (issued, began, _, call_op) in enumerate(runs):
            if k in taken or call_op not in ops or issued < s.t0 - SLACK_NS:
                continue
            if issued <= s.t1:
                marked[i] = s._replace(meta={**s.meta, "ran_ns": began})
                taken.add(k)
            break
    return [marked.get(i, s) for i, s in enumerate(spans)]


def timed(fn, *args, **kwargs):
    """On a rank (inside ``cluster.run``): ``fn(*args, **kwargs)``, its lablib spans recorded as usual,
    with ``torch.profiler`` watching when the backend really ran each collective (see the module's
    docstring): ``cluster.run(lablib.timed, train, ...)``. On a GPU the spans are placed where their
    kernels ran (``lablib.gputime``), which says when NCCL ran each collective."""
    from .comm import synchronize
    from .gputime import pauses_kept, profiler

    with profiler() as prof, pauses_kept() as pauses:
        mark_ns = _mark()
        result = fn(*args, **kwargs)
        synchronize()
    if RECORDER.spans is not None:
        events = _events(prof)
        spans = mark_runs(RECORDER.spans, backend_runs(events, mark_ns))
        RECORDER.spans[:] = place(spans, events, mark_ns, pauses)
    return result


def _marker(name: str) -> None:
    from torch.profiler import record_function

    with record_function(name):
        pass


def steps_begin() -> None:
    """Called by ``fn`` under ``profiled`` where the part worth drawing begins (after set-up and warm-up):
    what the profiler saw before it is left out."""
    _marker(STEPS[0])


def steps_end() -> None:
    """Called by ``fn`` under ``profiled`` where the part worth drawing ends (before gathering results): what
    began after it is left out."""
    _marker(STEPS[1])


def window(events: list[dict], mark_ns: int) -> tuple[float, float]:
    """Where the part worth drawing began and ended on this rank's clock: the last ``steps_begin`` and
    ``steps_end`` markers in the profile (without them, all of it), read on the profiler's clock as the spans
    are, so the marker that ties the clocks together shifts both alike."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    offset, _ = clock_offset(xs, mark_ns)
    at = [max((round(e["ts"] * 1000) + offset for e in xs if e["name"] == name), default=None) for name in STEPS]
    return (-math.inf if at[0] is None else at[0]), (math.inf if at[1] is None else at[1])


def profiled(fn, *args, **kwargs):
    """On a rank (inside ``cluster.run``): ``fn(*args, **kwargs)`` under ``torch.profiler``; what the
    profiler saw is recorded as this job's spans (instead of the lablib spans ``fn`` records): those that
    began between where ``fn`` called ``steps_begin()`` and ``steps_end()``, if it did."""
    from .comm import synchronize
    from .gputime import KEEP, pauses_kept, profiler

    own, RECORDER.spans = RECORDER.spans, None
    try:
        with profiler() as prof, pauses_kept() as pauses:
            mark_ns = _mark()
            result = fn(*args, **kwargs)
            synchronize()
    finally:
        RECORDER.spans = own
    events = _events(prof)
    if RECORDER.spans is not None:
        begin, end = window(events, mark_ns)
        host = [e for e in events if str(e.get("cat", "")).lower() not in KEEP or e.get("name") == MARK]
        spans = [s for s in spans_from_trace(host, mark_ns) if begin <= s.t0 < end]  # where the host began them
        RECORDER.spans.extend(place(spans, events, mark_ns, pauses))
    return result


profiled.own_profiler = timed.own_profiler = True  # gputime.timed_on_device leaves them to place their spans
