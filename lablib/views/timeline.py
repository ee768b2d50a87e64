"""Drawing timelines: per rank a compute lane and a communication lane, a colour per operation, short
labels on wide bars, messages as arrows from send to matching recv, and the overlap numbers under the
chart. Idle is what is not drawn: the gaps. The part of a collective or a recv spent before the last
peer arrived is drawn light grey ("waiting for a peer"), apart from the transfer, and a collective
still queued behind the rank's earlier ones (where ``lablib.timed`` saw when the backend began it) is
a thin line in its colour.

Bars are thick WebGL line segments (``scattergl``), not shapes or SVG bars, so a 10,000-span pipeline
run still draws and zooms at once (benchmarks/bench_timeline.py measures it). Colours are the
Okabe-Ito palette, readable with the common colour-vision deficiencies, plus Tol's for the rarer ops.
"""
from __future__ import annotations

import dataclasses
import re

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..overlap import op_of, phases
from .layout import tidy

_LEGEND = 48  # px over the chart for the legend's two rows

# op: (colour, label prefix, legend name)
OPS = {
    "forward": ("#0072B2", "F", "forward"),
    "backward": ("#56B4E9", "B", "backward"),
    "weight_grad": ("#009E73", "W", "weight gradient"),
    "compute": ("#6C7A89", "", "compute"),
    "all_gather": ("#E69F00", "AG", "all-gather"),
    "reduce_scatter": ("#D55E00", "RS", "reduce-scatter"),
    "all_reduce": ("#CC79A7", "AR", "all-reduce"),
    "tp_all_reduce": ("#CC79A7", "TP", "all-reduce, tp group"),
    "dp_all_reduce": ("#E69F00", "DP", "all-reduce, dp group"),
    "pp_broadcast": ("#999933", "PP", "broadcast, pp group"),
    "send": ("#222222", "S", "send"),
    "recv": ("#882255", "R", "recv"),
    "broadcast": ("#999933", "BC", "broadcast"),
    "all_to_all": ("#44AA99", "A2A", "all-to-all"),
    "barrier": ("#BBBBBB", "", "barrier"),
    "checkpoint": ("#117733", "CK", "checkpoint (files)"),
    "comm": ("#AA4499", "", "comm"),
    "idle": ("#DDDDDD", "", "marked idle"),
    "waiting": ("#D9D9D9", "", "waiting for a peer"),
    "outline": ("#666666", "", "outline"),
}
LANES = ("compute", "comm")
LEGENDS = {"queued": "queued (behind earlier collectives)", "later": "outlined: a rank's later stage"}
ARROW_LIMIT = 400  # more messages than this are drawn as plain lines (SVG arrows get slow)
_NUMBER = re.compile(r"(?:unit|layer|L|chunk|step|mb|micro-?batch)\s*(\d+)", re.I)


def fmt_bytes(n):
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def lane_y(rank: int, lane: str, compact: bool = False) -> int:
    """Rank r's compute lane is row 3r, its comm lane 3r + 1; row 3r + 2 is the gap to the next rank.
    ``compact`` (a timeline with no communication, such as a planned schedule): no comm lanes, rank r's
    compute lane is row 2r."""
    return 2 * rank if compact else 3 * rank + LANES.index(lane)


# Sends and recvs often run at once (isend + irecv), and so do asynchronous all-gathers and
# reduce-scatters (FSDP's prefetch under the backward): each pair shares the comm lane in two halves.
HALF = {"send": -0.2, "recv": 0.2}
ASYNC_HALF = {"all_gather": -0.2, "reduce_scatter": 0.2}


def half(span) -> float | None:
    """Where in the comm lane a half-height bar sits, or None for a full one."""
    if span.kind != "comm":
        return None
    return HALF.get(op_of(span), ASYNC_HALF.get(op_of(span)) if span.is_async else None)


def span_y(span, compact: bool = False) -> float:
    lane = lane_y(span.rank, "comm" if span.kind == "comm" else "compute", compact)
    return lane + (half(span) or 0.0)


def compact(timeline) -> bool:
    """Whether a timeline has nothing to draw in comm lanes (a planned schedule): then it has none."""
    return not any(s.kind == "comm" for s in timeline.spans)


def later_stage(span, world_size: int) -> bool:
    """A bar of a rank's second (or later) pipeline stage, in interleaved schedules (stage s on rank s % p):
    drawn outlined, so a rank's two stages differ at a glance."""
    stage = span.meta.get("stage")
    return isinstance(stage, int) and stage >= world_size


def fits(text: str, width: float) -> bool:
    """Whether ``text`` fits on a bar ``width`` of the chart's width long (10 px type on a plot area
    about 800 px wide, as in a notebook: some 6.5 px a character, and a little room either side)."""
    return width * 800 >= 6.5 * len(text) + 6


def label(span) -> str:
    """A short label: ``meta["label"]``, else a short name as is, else the op's prefix and the layer,
    unit, chunk or step it belongs to (from its metadata or its name): "F3", "AG1", "RS"."""
    if "label" in span.meta:
        return str(span.meta["label"])
    if len(span.name) <= 6:
        return span.name
    prefix = OPS.get(op_of(span), OPS["comm"])[1]
    if not prefix:
        return ""
    number = next((span.meta[k] for k in ("layer", "unit", "chunk", "step") if k in span.meta), None)
    if number is None:
        found = _NUMBER.search(span.name)
        number = found.group(1) if found else ""
    return f"{prefix}{number}"


def _bars(timeline, show_legend=True, shown: set | None = None, span: float | None = None):
    """The traces of one timeline: one WebGL trace per op, and one trace of labels. ``shown``: the ops
    already in the legend (several timelines in one figure list each op once); ``span``: the seconds the
    shared time axis spans (default: this timeline's), which decides where a label fits."""
    shown = set() if shown is None else shown
    flat = compact(timeline)
    spans = [s for s in timeline.spans if s.kind in ("compute", "comm", "idle")]
    total = span or timeline.duration or 1.0
    cut = phases(spans, timeline.world_size)
    by_op: dict[str, list] = {}
    moving_from = {}  # where each span's own bar (and label) starts
    for s in spans:
        op = op_of(s) if op_of(s) in OPS else s.kind
        thin = "/half" if half(s) is not None else ""
        running, t = cut.get(id(s), (s.start, s.start))
        if running > s.start:  # queued behind this rank's earlier collectives: a thin line in the op's colour
            by_op.setdefault(op + "/queued", []).append((s, s.start, running))
        if t > running:  # the part before the last peer arrived is waiting, drawn apart from the transfer
            by_op.setdefault("waiting" + thin, []).append((s, running, t))
        by_op.setdefault(op + thin, []).append((s, t, s.end))
        if not thin and later_stage(s, timeline.world_size):  # an outline under the bar: drawn first
            by_op.setdefault("outline/later", []).append((s, t, s.end))
        moving_from[id(s)] = t
    traces = []
    for key, group in sorted(by_op.items(), key=lambda item: item[0] != "outline/later"):
        op, style = key.split("/")[0], key.partition("/")[2]
        colour, _, name = OPS[op]
        xs, ys, texts = [], [], []
        for s, start, end in group:
            y = span_y(s, flat)
            what = {"queued": f"queued: {s.name} waits for the rank's earlier collectives"}.get(
                style, f"waiting for a peer in {s.name}" if op == "waiting" else s.name)
            hover = (f"<b>{what}</b><br>rank {s.rank}, {OPS.get(op_of(s), OPS['comm'])[2]}<br>"
                     f"start {start * 1e3:.3f} ms<br>duration {(end - start) * 1e3:.3f} ms"
                     + (f"<br>{fmt_bytes(s.bytes)}" if s.bytes and op != "waiting" and style != "queued" else "")
                     + (f"<br>simulated link: {s.meta['simulated']}" if s.meta.get("simulated") else ""))
            xs += [start * 1e3, (start + end) / 2 * 1e3, end * 1e3, None]
            ys += [y, y, y, None]
            texts += [hover, hover, hover, None]
        legend = style if style in ("queued", "later") else op
        first = legend not in shown  # one legend entry per op, one for every queued line, one for later stages
        shown.add(legend)
        width = {"queued": 3, "half": 7, "later": 17}.get(style, 14)
        traces.append(go.Scattergl(x=xs, y=ys, mode="lines", name=LEGENDS.get(style, name), legendgroup=legend,
                                   showlegend=show_legend and first, text=texts, hovertemplate="%{text}<extra></extra>",
                                   line=dict(color=colour, width=width), connectgaps=False))
    # a label sits on the bar's coloured part, and only where that part is wide enough to hold it; a rank's
    # later stages name their stage ("F3·s2") where there is room
    several = {s.rank for s in spans if later_stage(s, timeline.world_size)}  # ranks that hold several stages
    texts = []
    for s in spans:
        width = (s.end - moving_from[id(s)]) / total
        text = label(s) if s.depth == 0 and half(s) is None else ""
        if text and s.rank in several and "stage" in s.meta:
            longer = f"{text}·s{s.meta['stage']}"
            text = longer if fits(longer, width) else text
        if text and fits(text, width):
            texts.append((s, text))
    if texts:
        traces.append(go.Scattergl(
            x=[(moving_from[id(s)] + s.end) / 2 * 1e3 for s, _ in texts], y=[span_y(s, flat) for s, _ in texts],
            mode="text", text=[t for _, t in texts], textfont=dict(color="white", size=10), hoverinfo="skip",
            showlegend=False, name="labels"))
    arrows = [] if flat else _arrows(timeline, show_legend and "message" not in shown)
    if arrows:
        shown.add("message")
    return traces + arrows


def _arrows(timeline, show_legend):
    pairs = timeline.messages()
    if not pairs:
        return []
    xs, ys, sizes, texts = [], [], [], []
    for send, recv in pairs:
        t0 = max(send.start, recv.start)  # the data can move once both sides are there
        xs += [t0 * 1e3, recv.end * 1e3, None]
        ys += [span_y(send), span_y(recv), None]
        sizes += [0, 11, 0]
        what = f"rank {send.rank} → rank {recv.rank}: {send.name}" + (f", {fmt_bytes(send.bytes)}" if send.bytes else "")
        texts += [what, what, None]
    common = dict(x=xs, y=ys, name="message", mode="lines+markers" if len(pairs) <= ARROW_LIMIT else "lines",
                  line=dict(color="#444444", width=1.2), text=texts, hovertemplate="%{text}<extra></extra>",
                  showlegend=show_legend, legendgroup="message")
    if len(pairs) <= ARROW_LIMIT:
        return [go.Scatter(marker=dict(symbol="arrow", angleref="previous", size=sizes, color="#444444"), **common)]
    return [go.Scattergl(**common)]


def lane_clocks(timeline) -> dict[tuple[int, str], str]:
    """(rank, lane) -> the clock its bars were placed by, where a run says (``lablib.gputime`` on a GPU: "GPU
    kernels", "host", or both where the lane holds some of each)."""
    seen: dict = {}
    for s in timeline.spans:
        if s.meta.get("clock"):
            lane = (s.rank, "comm" if s.kind == "comm" else "compute")
            seen.setdefault(lane, set()).update(s.meta["clock"].split(" + "))
    return {key: " + ".join(sorted(clocks)) for key, clocks in seen.items()}


def _axis(fig, timeline, row=None, col=None, flat=False):
    world_size, clocks = timeline.world_size, lane_clocks(timeline)
    lanes = ("compute",) if flat else LANES
    ticks = [lane_y(r, lane, flat) for r in range(world_size) for lane in lanes]
    text = [(f"rank {r}" if flat else f"rank {r} {lane}")
            + (f"<br><span style='font-size:9px'>{clocks[r, lane]}</span>" if (r, lane) in clocks else "")
            for r in range(world_size) for lane in lanes]
    fig.update_yaxes(tickmode="array", tickvals=ticks, ticktext=text,
                     range=[(2 if flat else 3) * world_size - (1.4 if flat else 1.5), -0.6],
                     zeroline=False, showgrid=False, row=row, col=col)


def _table(timeline):
    rows = timeline.summary()
    ms = lambda key: [f"{rows[r][key] * 1e3:.2f}" for r in rows]  # noqa: E731
    header = ["rank", "compute ms", "comm ms", "hidden ms", "exposed ms", "waiting ms", "idle ms",
              "overlap = hidden / comm"]
    cells = [[f"rank {r}" for r in rows], ms("compute"), ms("comm"), ms("hidden"), ms("exposed"), ms("waiting"),
             ms("idle"), [f"{rows[r]['overlap']:.0%}" for r in rows]]
    return go.Table(header=dict(values=header, fill_color="#EEEEEE", align="right"),
                    cells=dict(values=cells, align="right", height=22))


def timeline_figure(timeline, title: str | None = None, numbers: bool = True):
    """One timeline: lanes per rank, ops in colour, messages as arrows, and (``numbers``) the per-rank
    overlap numbers in a table under it."""
    n = timeline.world_size
    flat = compact(timeline)
    chart_h = 90 + (40 if flat else 62) * n
    if numbers:
        table_h = 40 + 24 * n
        fig = make_subplots(rows=2, cols=1, vertical_spacing=80 / (chart_h + table_h + 80), row_heights=[chart_h, table_h],
                            specs=[[{"type": "xy"}], [{"type": "table"}]])
        for t in _bars(timeline):
            fig.add_trace(t, row=1, col=1)
        fig.add_trace(_table(timeline), row=2, col=1)
        _axis(fig, timeline, row=1, col=1, flat=flat)
        fig.update_xaxes(title="time since the job started (ms)", row=1, col=1)
    else:
        table_h = 0
        fig = go.Figure(_bars(timeline))
        _axis(fig, timeline, flat=flat)
        fig.update_xaxes(title="time since the job started (ms)")
    # the title under the toolbar (tidy), the legend (two rows where it has many entries) between it and the chart
    fig.update_layout(title=title if title is not None else (timeline.title or "Per-rank timeline"),
                      margin=dict(l=110, r=20, t=0, b=10),
                      legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right"),
                      plot_bgcolor="white", hovermode="closest")
    tidy(fig, above=_LEGEND)
    return fig.update_layout(height=chart_h + table_h + 90 + fig.layout.margin.t)


def _from_zero(timeline):
    """The same timeline with its first span at t = 0, so runs line up by their own start."""
    t0 = min((s.start for s in timeline.spans), default=0.0)
    spans = [dataclasses.replace(s, start=s.start - t0, end=s.end - t0,
                                 runs_from=None if s.runs_from is None else s.runs_from - t0) for s in timeline.spans]
    return type(timeline)(spans, timeline.world_size, timeline.clock_error, timeline.title)


def compare_figure(timelines, titles=None, steps=None, title: str = ""):
    """Two or more timelines one above the other on a shared time axis (each from its own first span),
    each titled with its step time and the change against the first: the drawn timeline's length, or
    ``steps`` (seconds, one per timeline: e.g. the median over several steps, of which the drawn one is
    the last)."""
    titles = titles or [t.title or f"run {i + 1}" for i, t in enumerate(timelines)]
    timelines = [_from_zero(t) for t in timelines]
    if len(titles) != len(timelines):
        raise ValueError(f"compare: {len(timelines)} timelines but {len(titles)} titles")
    if steps is not None and len(steps) != len(timelines):
        raise ValueError(f"compare: {len(timelines)} timelines but {len(steps)} step times")
    times = list(steps) if steps is not None else [t.duration for t in timelines]
    base = times[0]
    heads = []
    for i, (t, name, time) in enumerate(zip(timelines, titles, times)):
        pct = 100 * (time - base) / base if i and base else None
        change = ("" if pct is None else f", the same as {titles[0]}" if abs(pct) < 0.5 else  # no "-0%"
                  f", {pct:+.0f}% vs {titles[0]}")
        drawn = "" if steps is None else f" (drawn: the last, {t.duration * 1e3:.2f} ms)"
        heads.append(f"{name}: {'median step ' if steps is not None else ''}{time * 1e3:.2f} ms{change}{drawn}")
    heights = [(2 if compact(t) else 3) * t.world_size for t in timelines]
    fig = make_subplots(rows=len(timelines), cols=1, shared_xaxes=True, vertical_spacing=0.12 / len(timelines),
                        subplot_titles=heads, row_heights=heights)
    shown: set = set()
    axis = max(t.duration for t in timelines) or None  # one axis: a label fits by the span it shares
    for i, t in enumerate(timelines, start=1):
        for trace in _bars(t, shown=shown, span=axis):
            fig.add_trace(trace, row=i, col=1)
        _axis(fig, t, row=i, col=1, flat=compact(t))
    fig.update_xaxes(title="time since each run's first span (ms)", row=len(timelines), col=1)
    fig.update_layout(margin=dict(l=110, r=20, t=0, b=90), legend=dict(orientation="h", y=0, yanchor="bottom", x=0,
                                                                    yref="container"), plot_bgcolor="white", title=title)
    tidy(fig)  # the title under the toolbar, the runs' titles under it
    return fig.update_layout(height=90 + fig.layout.margin.t + sum((40 if compact(t) else 62) * t.world_size + 40
                                                                   for t in timelines))
