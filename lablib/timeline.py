"""Spans per rank on one clock: recorded cheaply inside rank code, merged and drawn in the notebook.

Rank code marks what it does::

    with lablib.span("fwd L0"):                  # kind="compute" by default
        y = layer(x)
    with lablib.span("grad sync", kind="comm", bytes=g.nbytes):
        dist.all_reduce(g)

Recording is two ``perf_counter_ns`` calls and a list append (a benchmark in ``benchmarks/`` holds
it under 5% of a lab-sized training step). Outside a ``Cluster`` job nothing is recorded, so the
same code runs unchanged in a single process.

A ``Timeline`` holds the spans of one job from every rank, shifted onto the parent's clock. It draws
itself (a compute and a comm lane per rank, messages as arrows, the overlap numbers of
``lablib.overlap`` under the chart), ``compare`` draws several one above the other, and it exports
Chrome-trace JSON with flow arrows for Perfetto (https://ui.perfetto.dev) or chrome://tracing.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("compute", "comm", "idle")



class _Clock:
    """This rank's clock for spans, in ns: ``perf_counter_ns`` less ``paused``, the time spent in real
    transfers standing in for a simulated link (``comm.simulated``); 0 otherwise. ``changes``, while a list
    (``gputime`` on a GPU): (``perf_counter_ns``, ``paused`` from then on) at each change, to put the GPU's
    records on this clock."""
    paused = 0
    changes: list | None = None

    def set_paused(self, paused: int) -> None:
        self.paused = paused
        if self.changes is not None:
            self.changes.append((time.perf_counter_ns(), paused))


CLOCK = _Clock()


def _now() -> int:
    return time.perf_counter_ns() - CLOCK.paused


class RawSpan(NamedTuple):
    """One span as a rank records it: its own clock, in ns. ``Timeline.from_raw`` makes ``Span``s."""
    name: str
    kind: str
    t0: int
    t1: int
    depth: int
    bytes: int | None
    is_async: bool
    meta: dict


class _Recorder:
    """The spans of the job running in this process; ``spans is None`` means "not recording"."""

    def __init__(self):
        self.spans: list | None = None
        self.depth = 0

    def start(self):
        self.spans, self.depth = [], 0

    def stop(self) -> list:
        spans, self.spans = self.spans or [], None
        return spans


RECORDER = _Recorder()


class span:
    """Context manager marking one piece of work on this rank: ``with span("fwd L0"): ...``.

    ``kind`` is "compute", "comm" or "idle"; ``bytes`` (optional) is shown on hover; other keyword
    arguments are kept as metadata and exported to the Chrome trace.
    """

    __slots__ = ("name", "kind", "bytes", "meta", "t0", "depth")

    def __init__(self, name: str, kind: str = "compute", bytes: int | None = None, **meta):
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
        self.name, self.kind, self.bytes, self.meta = str(name), kind, bytes, meta

    def __enter__(self):
        self.depth = RECORDER.depth
        RECORDER.depth += 1
        self.t0 = _now()
        return self

    def __exit__(self, *exc):
        t1 = _now()
        RECORDER.depth -= 1
        if RECORDER.spans is not None:
            RECORDER.spans.append(RawSpan(self.name, self.kind, self.t0, t1, self.depth, self.bytes, False, self.meta))
        return False


_CLOSING = threading.Lock()


class AsyncSpan:
    """A span opened now and closed later, from whichever thread sees the work complete.

    Used for ``async_op=True`` collectives: the bar runs from issue to completion, and is drawn apart
    from the compute it overlaps with.
    """

    __slots__ = ("name", "kind", "bytes", "meta", "t0", "closed", "_into")

    def __init__(self, name, kind="comm", bytes=None, **meta):
        self.name, self.kind, self.bytes, self.meta = name, kind, bytes, meta
        self.t0, self.closed = _now(), False
        self._into = RECORDER.spans  # its own job's spans: one that completes late never lands in the next job's

    def close(self, *_, at: int | None = None):
        """Close now, or at ``at`` (ns on this rank's clock: a simulated link's completion)."""
        with _CLOSING:  # the backend's thread and wait() may both close it
            if self.closed:
                return
            self.closed = True
        spans = self._into
        if spans is not None:
            spans.append(RawSpan(self.name, self.kind, self.t0, at or _now(), 0, self.bytes, True, self.meta))


@dataclass(frozen=True)
class Span:
    rank: int
    name: str
    kind: str
    start: float  # seconds since the start of the job, on the parent's clock
    end: float
    depth: int = 0
    bytes: int | None = None
    is_async: bool = False
    meta: dict = field(default_factory=dict)
    runs_from: float | None = None  # when the backend began running this collective (None: not known)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def running(self) -> float:
        """When the work itself began: ``runs_from`` where the backend's own record says (before it, the
        collective was queued behind others this rank had issued), else the start."""
        return self.start if self.runs_from is None else min(max(self.runs_from, self.start), self.end)


class Timeline:
    """The merged spans of one job, every rank on one clock (seconds since the job started)."""

    def __init__(self, spans: list[Span], world_size: int, clock_error: float = 0.0, title: str = ""):
        self.spans = sorted(spans, key=lambda s: (s.rank, s.start, s.depth))
        self.world_size = world_size
        self.clock_error = clock_error  # bound on how far two ranks' clocks may disagree, seconds
        self.title = title

    @classmethod
    def from_raw(cls, raw_by_rank: dict, offsets: dict, origin_ns: int, world_size: int, **kw) -> "Timeline":
        """Build from the ``RawSpan``s ranks recorded: ``offsets[rank]`` is (rank clock - parent clock) in ns."""
        spans = []
        for rank, raw in raw_by_rank.items():
            off = offsets.get(rank, 0) + origin_ns
            for r in raw:
                meta = dict(r.meta)
                ran = meta.pop("ran_ns", None)  # profiling.timed: when the backend ran it
                spans.append(Span(rank, r.name, r.kind, (r.t0 - off) / 1e9, (r.t1 - off) / 1e9, r.depth, r.bytes,
                                  r.is_async, meta, None if ran is None else (ran - off) / 1e9))
        return cls(spans, world_size, **kw)

    # -- numbers (overlap.py) -------------------------------------------------------------------
    def summary(self) -> dict[int, dict[str, float]]:
        """Seconds per rank: compute, comm (= hidden + exposed), hidden (under compute), exposed, waiting
        (blocked before the last peer arrived), idle (no work at all, waiting included), and the overlap
        fraction hidden / comm. See ``lablib.overlap``."""
        from .overlap import breakdown

        return breakdown(self.spans, self.world_size)

    def messages(self) -> list[tuple[Span, Span]]:
        """(send, matching recv) pairs: the k-th send from a to b with the k-th recv on b from a."""
        from .overlap import messages

        return messages(self.spans)

    @property
    def duration(self) -> float:
        """Seconds from the first span's start to the last span's end, over every rank."""
        return max((s.end for s in self.spans), default=0.0) - min((s.start for s in self.spans), default=0.0)

    def __repr__(self):
        lines = [f"Timeline: {len(self.spans)} spans on {self.world_size} ranks, {self.duration * 1e3:.2f} ms"]
        for r, row in self.summary().items():
            lines.append(f"  rank {r}: compute {row['compute'] * 1e3:.2f} ms, comm {row['comm'] * 1e3:.2f} ms "
                         f"(hidden {row['hidden'] * 1e3:.2f}, exposed {row['exposed'] * 1e3:.2f}), waiting "
                         f"{row['waiting'] * 1e3:.2f} ms, idle {row['idle'] * 1e3:.2f} ms, "
                         f"overlap (hidden / comm) {row['overlap']:.0%}")
        return "\n".join(lines)

    # -- drawing (lablib.views.timeline: the notebook side) ------------------------------------------
    def figure(self, title: str | None = None, numbers: bool = True):
        """The chart: per rank a compute and a comm lane, a colour per op, messages as arrows, and
        (``numbers``) the overlap numbers per rank under it. See ``lablib.views.timeline``."""
        from .views.timeline import timeline_figure

        return timeline_figure(self, title=title, numbers=numbers)

    def _repr_mimebundle_(self, include=None, exclude=None):
        # The plotly JSON mimetype renders in JupyterLab, VS Code and nbviewer and is stable under nbval.
        # remove_uids keeps re-executed outputs identical.
        import plotly.io as pio

        fig = json.loads(pio.to_json(self.figure(), validate=False, remove_uids=True))
        return {"application/vnd.plotly.v1+json": fig, "text/plain": repr(self)}

    # -- Chrome trace / Perfetto -------------------------------------------------------------------
    def chrome_trace(self) -> dict:
        """The Trace Event Format dict: a process per rank with a compute and a comm thread (the lanes
        of the chart), and each message as a flow arrow from its send to its matching recv."""
        events = []
        for r in range(self.world_size):
            events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
            for tid, lane in enumerate(("compute", "comm")):
                events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
        for s in self.spans:
            args = {k: v for k, v in s.meta.items() if isinstance(v, (int, float, str, bool))}
            args.update({k: v for k, v in (("bytes", s.bytes), ("depth", s.depth), ("async", s.is_async)) if v})
            if s.runs_from is not None:
                args["queued_us"] = round((s.running - s.start) * 1e6, 3)
            events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": s.rank, "tid": int(s.kind == "comm"),
                           "ts": round(s.start * 1e6, 3), "dur": round(s.duration * 1e6, 3), "args": args})
        for k, (send, recv) in enumerate(self.messages()):
            common = {"name": "message", "cat": "message", "id": k, "tid": 1}
            events.append({**common, "ph": "s", "pid": send.rank, "ts": round(send.start * 1e6, 3)})
            events.append({**common, "ph": "f", "bp": "e", "pid": recv.rank, "ts": round(recv.start * 1e6, 3)})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"title": self.title, "world_size": self.world_size, "clock_error": self.clock_error}}

    @classmethod
    def load(cls, path) -> "Timeline":
        """A timeline back from the Chrome trace ``save_chrome_trace`` (or ``lablib.run``) wrote."""
        with open(path) as f:
            trace = json.load(f)
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ValueError(f"{path} is not a Chrome trace: no traceEvents list")
        spans = []
        for e in trace["traceEvents"]:
            if e.get("ph") != "X" or e.get("cat") not in KINDS:
                continue
            meta = dict(e.get("args") or {})
            nbytes, depth, is_async = meta.pop("bytes", None), meta.pop("depth", 0), meta.pop("async", False)
            queued = meta.pop("queued_us", None)
            start = e["ts"] / 1e6
            spans.append(Span(int(e["pid"]), e["name"], e["cat"], start, start + e["dur"] / 1e6, depth, nbytes,
                              is_async, meta, None if queued is None else start + queued / 1e6))
        info = trace.get("otherData") or {}
        ranks = info.get("world_size") or 1 + max((s.rank for s in spans), default=0)
        return cls(spans, int(ranks), float(info.get("clock_error", 0.0)), str(info.get("title", "")))

    def save_chrome_trace(self, path) -> str:
        """Write the Chrome-trace JSON to ``path``; open it at https://ui.perfetto.dev."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return str(path)


def noted(slot: list, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and what lablib's helpers noted in ``slot`` (a one-item list) meanwhile: a check's
    record of the calls the learner's code made (``attend``'s blocks, ``expert``'s tokens), in order."""
    slot[0] = []
    try:
        return fn(*args, **kwargs), list(slot[0])
    finally:
        slot[0] = None


def compare(*timelines: Timeline, titles=None, steps=None, title: str = ""):
    """Timelines one above the other on one time axis (e.g. without and with prefetch), each titled with
    its step time and the change against the first: the drawn timeline's, or ``steps`` (seconds, one per
    timeline, e.g. the medians ``prefetch.measure`` gives). ``title``: what they all share, above them."""
    from .views.timeline import compare_figure

    return compare_figure(list(timelines), titles, steps, title)
