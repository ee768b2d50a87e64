"""Drawing a ``Timeline``: a plotly Gantt chart, a row per rank."""
from __future__ import annotations

import plotly.graph_objects as go

# One colour per span kind (timeline.KINDS); the drawing imports nothing from the timeline itself.
COLORS = {"compute": "#4C78A8", "comm": "#F58518", "idle": "#D3D3D3"}


def fmt_bytes(n):
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def timeline_figure(timeline, show_idle: bool = True, title: str | None = None):
    """A plotly Gantt chart: a row per rank, compute / comm / idle in distinct colours.

    Nested spans are drawn thinner on top of their parent; async comm spans run along the lower
    edge of the row, so overlap with compute is visible."""
    items = list(timeline.spans) + (timeline.idle() if show_idle else [])
    fig = go.Figure()
    for kind in COLORS:
        for is_async in (False, True):
            group = [s for s in items if s.kind == kind and s.is_async == is_async]
            if not group:
                continue
            widths, offsets = [], []
            for s in group:
                if is_async:
                    w, off = 0.22, -0.42
                else:
                    w = max(0.8 - 0.2 * s.depth, 0.2)
                    off = -w / 2
                widths.append(w)
                offsets.append(off)
            fig.add_trace(go.Bar(
                orientation="h",
                name=kind + (" (async)" if is_async else ""),
                y=[s.rank for s in group],
                base=[s.start * 1e3 for s in group],
                x=[max(s.duration * 1e3, 1e-4) for s in group],
                width=widths,
                offset=offsets,
                marker=dict(color=COLORS[kind], opacity=0.6 if is_async else 1.0,
                            line=dict(width=0.5, color="white")),
                customdata=[[s.name, s.duration * 1e3, fmt_bytes(s.bytes), s.start * 1e3] for s in group],
                hovertemplate=("<b>%{customdata[0]}</b><br>rank %{y}<br>start %{customdata[3]:.3f} ms<br>"
                               "duration %{customdata[1]:.3f} ms<br>%{customdata[2]}<extra>" + kind + "</extra>"),
            ))
    fig.update_layout(
        title=title if title is not None else (timeline.title or "Per-rank timeline"),
        barmode="overlay",
        xaxis_title="time since the job started (ms)",
        yaxis=dict(tickmode="array", tickvals=list(range(timeline.world_size)),
                   ticktext=[f"rank {r}" for r in range(timeline.world_size)], autorange="reversed"),
        height=120 + 60 * timeline.world_size,
        margin=dict(l=60, r=20, t=50, b=40),
        legend=dict(orientation="h", y=-0.25 if timeline.world_size < 4 else -0.15),
    )
    return fig
