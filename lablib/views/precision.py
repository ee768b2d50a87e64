"""Lab 09's figures: a reduction's error against the number of ranks, loss curves, the bytes a step sends
per dtype and the bytes each rank wrote and held for a checkpoint."""
from __future__ import annotations

from .layout import tidy


def lines_figure(series: dict, title: str, xaxis: str, yaxis: str, log_y: bool = False, log_x: bool = False,
                 dash: tuple = ()):
    """``series``: {label: (xs, ys)}, one line each (dotted where the label is in ``dash``)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, (xs, ys) in series.items():
        fig.add_trace(go.Scatter(x=list(xs), y=list(ys), mode="lines+markers" if len(xs) < 20 else "lines",
                                 name=label, line=dict(dash="dot" if label in dash else None)))
    fig.update_layout(height=360, title=title, xaxis_title=xaxis, yaxis_title=yaxis,
                      yaxis_type="log" if log_y else None, xaxis_type="log" if log_x else None, legend=dict(orientation="h", y=-0.2))
    return tidy(fig)


def bars_figure(groups: dict, title: str, yaxis: str):
    """``groups``: {series: {category: value}}: grouped bars, the value written on each."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, values in groups.items():
        fig.add_trace(go.Bar(name=label, x=list(values), y=list(values.values()),
                             text=[f"{v / 1024:.1f} KiB" for v in values.values()], textposition="outside"))
    fig.update_layout(barmode="group", height=380, title=title, yaxis_title=yaxis, legend=dict(orientation="h", y=-0.2))
    return tidy(fig)
