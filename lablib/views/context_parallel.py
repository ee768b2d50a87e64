"""Lab 06's figures: each rank's attention work and CPU time, contiguous against zig-zag, and the
activation memory a rank holds against the sequence length at 1, 2 and 4 ranks."""
from __future__ import annotations


def work_figure(runs: dict):
    """``runs``: {layout: (per-rank work, per-rank CPU seconds)}: two bar charts side by side. CPU time, not
    the timeline's wall time: ranks that share cores take turns, and wall time would show the turns."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(1, 2, subplot_titles=("attention work (query-key pairs, counted)",
                                              "CPU time in the step, ms (measured)"))
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
                                 name=f"P = {p}, what autograd keeps (measured)"))
        fig.add_trace(go.Scatter(x=[r["tokens"] for r in mine], y=[r["kept"] / 2**20 for r in mine], mode="lines+markers",
                                 line=dict(dash="dot"), name=f"P = {p}, recompute from lse (counted)"))
    fig.update_layout(title="Activation memory per rank for one attention layer", xaxis_title="sequence length (tokens)",
                      yaxis_title="MiB per rank (log scale)", yaxis_type="log", height=380, margin=dict(t=50))
    return fig
