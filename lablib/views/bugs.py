"""Lab 10's figures: the factor each parameter's gradient is off by in each broken step, and every rank's
flight recorder side by side with the point where the ranks parted."""
from __future__ import annotations

import math

from .layout import tidy
from .precision import lines_figure  # noqa: F401 - the replicas' drift is drawn with it


def factors_figure(factors: dict, title: str = "The factor each gradient is off by, against one process"):
    """``factors``: {step: {parameter: factor or None}}, as a grid: 1 white, a multiple coloured by its size
    (log scale), None (no multiple) marked."""
    import plotly.graph_objects as go

    steps = list(factors)
    params = list(next(iter(factors.values())))
    z = [[None if f is None else math.log2(abs(f)) if f else None for f in row.values()] for row in factors.values()]
    text = [["none" if f is None else f"{f:.4g}×" for f in row.values()] for row in factors.values()]
    fig = go.Figure(go.Heatmap(z=z, x=params, y=steps, text=text, texttemplate="%{text}", zmid=0,
                               colorscale="RdBu_r", colorbar=dict(title="log2 |factor|"), hoverongaps=False))
    fig.update_layout(height=120 + 48 * len(steps), title=title, xaxis_title="parameter",
                      yaxis=dict(autorange="reversed"))
    return tidy(fig)


def flights_figure(flights: dict, parted=None, title: str = "What each rank last issued (its flight recorder)"):
    """``flights``: {rank: entries}; one row per rank, one marker per call at its seq, one colour per kind of
    call (op, bytes, dtype, shape); ``parted``: the seq at which the ranks parted, marked."""
    import plotly.graph_objects as go

    from ..flight import line

    kinds: dict = {}
    fig = go.Figure()
    for rank, entries in flights.items():
        for e in entries:
            kinds.setdefault(e[1:5], []).append((e[0], rank, line(e)))
    for kind, points in kinds.items():
        op, nbytes, dtype, shape = kind
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[f"rank {p[1]}" for p in points], mode="markers",
                                 marker=dict(size=11, symbol="square"), name=f"{op} {nbytes} B {dtype} {shape}",
                                 hovertext=[p[2] for p in points], hoverinfo="text"))
    if parted is not None:
        fig.add_vline(x=parted, line_dash="dot", line_color="crimson",
                      annotation_text=f"the ranks part at #{parted}", annotation_position="top")
    fig.update_layout(height=140 + 40 * len(flights), title=title, xaxis=dict(title="seq (each rank's own count of its "
                                                                                  "calls)", dtick=1),
                      yaxis=dict(autorange="reversed", categoryorder="array",
                                 categoryarray=[f"rank {r}" for r in flights]),
                      legend=dict(orientation="h", y=-0.35))
    return tidy(fig)
