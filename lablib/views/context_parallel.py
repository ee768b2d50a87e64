"""Lab 06's figures: each rank's attention work and compute time, contiguous against zig-zag, and the
activation memory a rank holds against the sequence length at 1, 2 and 4 ranks."""
from __future__ import annotations

from ..overlap import breakdown


def compute_seconds(timeline) -> list[float]:
    """Each rank's compute time on a run's timeline (measured)."""
    rows = breakdown(timeline.spans, timeline.world_size)
    return [rows[r]["compute"] for r in range(timeline.world_size)]


def work_figure(runs: dict):
    """``runs``: {layout: (per-rank work, per-rank compute seconds)}: two bar charts side by side."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(1, 2, subplot_titles=("attention work (query-key pairs, counted)",
                                              "compute time, ms (measured)"))
    colours = {"contiguous": "#E45756", "zigzag": "#4C78A8"}
    for layout, (work, seconds) in runs.items():
        x = [f"rank {r}" for r in range(len(work))]
        fig.add_trace(go.Bar(name=layout, x=x, y=work, marker_color=colours.get(layout), legendgroup=layout), 1, 1)
        fig.add_trace(go.Bar(name=layout, x=x, y=[s * 1e3 for s in seconds], marker_color=colours.get(layout),
                             legendgroup=layout, showlegend=False), 1, 2)
    fig.update_layout(barmode="group", height=340, margin=dict(t=60, b=40), legend=dict(orientation="h", y=-0.15),
                      title="Causal ring attention: each rank's share of the work")
    return fig


def memory_figure(rows: list[dict]):
    """``rows``: {"P", "tokens", "saved", "kept"}: activation bytes per rank against the sequence length,
    one line per P (measured: what autograd keeps through the ring; and what Task 6.3's recompute keeps)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for p in sorted({r["P"] for r in rows}):
        mine = [r for r in rows if r["P"] == p]
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in mine], y=[r["saved"] / 2**20 for r in mine], mode="lines+markers",
                                 name=f"P = {p}, autograd through the ring (measured)"))
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in mine], y=[r["kept"] / 2**20 for r in mine], mode="lines+markers",
                                 line=dict(dash="dot"), name=f"P = {p}, recompute from lse (counted)"))
    fig.update_layout(title="Activation memory per rank for one attention layer", xaxis_title="sequence length (tokens)",
                      yaxis_title="MiB per rank", height=380, margin=dict(t=50))
    return fig
