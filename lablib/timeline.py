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
itself as a plotly Gantt chart (a row per rank) and exports Chrome-trace JSON for Perfetto
(https://ui.perfetto.dev) or chrome://tracing.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("compute", "comm", "idle")

_now = time.perf_counter_ns


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


class AsyncSpan:
    """A span opened now and closed later, from whichever thread sees the work complete.

    Used for ``async_op=True`` collectives: the bar runs from issue to completion, and is drawn apart
    from the compute it overlaps with.
    """

    __slots__ = ("name", "kind", "bytes", "meta", "t0", "closed")

    def __init__(self, name, kind="comm", bytes=None, **meta):
        self.name, self.kind, self.bytes, self.meta = name, kind, bytes, meta
        self.t0, self.closed = _now(), False

    def close(self, *_):
        if self.closed:
            return
        self.closed = True
        spans = RECORDER.spans
        if spans is not None:
            spans.append(RawSpan(self.name, self.kind, self.t0, _now(), 0, self.bytes, True, self.meta))


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

    @property
    def duration(self) -> float:
        return self.end - self.start


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
            spans += [Span(rank, r.name, r.kind, (r.t0 - off) / 1e9, (r.t1 - off) / 1e9, r.depth, r.bytes, r.is_async,
                           dict(r.meta)) for r in raw]
        return cls(spans, world_size, **kw)

    # -- views ---------------------------------------------------------------------------------
    def idle(self) -> list[Span]:
        """Gaps in each rank's traced activity between the first and last span of any rank.

        Untraced code also shows up here, so wrap each rank's real work in spans."""
        if not self.spans:
            return []
        lo = min(s.start for s in self.spans)
        hi = max(s.end for s in self.spans)
        gaps = []
        for r in range(self.world_size):
            t = lo
            for s in sorted((s for s in self.spans if s.rank == r and not s.is_async), key=lambda s: s.start):
                if s.start > t:
                    gaps.append(Span(r, "idle (no span)", "idle", t, s.start))
                t = max(t, s.end)
            if hi > t:
                gaps.append(Span(r, "idle (no span)", "idle", t, hi))
        return gaps

    def summary(self) -> dict[int, dict[str, float]]:
        """Seconds per rank and kind (top-level sync spans plus the idle gaps; async spans separately)."""
        out = {r: {"compute": 0.0, "comm": 0.0, "idle": 0.0, "async comm": 0.0} for r in range(self.world_size)}
        for s in self.spans:
            if s.is_async:
                out[s.rank]["async comm"] += s.duration
            elif s.depth == 0:
                out[s.rank][s.kind] += s.duration
        for s in self.idle():
            out[s.rank]["idle"] += s.duration
        return out

    def __repr__(self):
        lines = [f"Timeline: {len(self.spans)} spans on {self.world_size} ranks"
                 + (f", span {max(s.end for s in self.spans) - min(s.start for s in self.spans):.4f} s" if self.spans else "")]
        for r, row in self.summary().items():
            lines.append(f"  rank {r}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in row.items() if v or k != "async comm"))
        return "\n".join(lines)

    # -- drawing (lablib.views.timeline: the notebook side) ------------------------------------------
    def figure(self, show_idle: bool = True, title: str | None = None):
        """A plotly Gantt chart: a row per rank, compute / comm / idle in distinct colours."""
        from .views.timeline import timeline_figure

        return timeline_figure(self, show_idle=show_idle, title=title)

    def _repr_mimebundle_(self, include=None, exclude=None):
        # The plotly JSON mimetype renders in JupyterLab, VS Code and nbviewer and is stable under nbval.
        # remove_uids keeps re-executed outputs identical.
        import plotly.io as pio

        fig = json.loads(pio.to_json(self.figure(), validate=False, remove_uids=True))
        return {"application/vnd.plotly.v1+json": fig, "text/plain": repr(self)}

    # -- Chrome trace / Perfetto -------------------------------------------------------------------
    def chrome_trace(self) -> dict:
        """The Trace Event Format dict: one thread per rank, async comm on a thread of its own."""
        events = []
        for r in range(self.world_size):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": r, "args": {"sort_index": 2 * r}})
            if any(s.rank == r and s.is_async for s in self.spans):
                tid = 1000 + r
                events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": f"rank {r} async comm"}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": 2 * r + 1}})
        events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": self.title or "lablib job"}})
        for s in self.spans:
            args = {k: v for k, v in s.meta.items() if isinstance(v, (int, float, str, bool))}
            if s.bytes is not None:
                args["bytes"] = s.bytes
            events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": 0, "tid": 1000 + s.rank if s.is_async else s.rank,
                           "ts": round(s.start * 1e6, 3), "dur": round(s.duration * 1e6, 3), "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path) -> str:
        """Write the Chrome-trace JSON to ``path``; open it at https://ui.perfetto.dev."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return str(path)
