"""Lab 07's figures: each rank's CPU time and wait in a layer, the tokens each expert computed at each
capacity factor, the load while training with and without the balancing loss, and the bytes each rank sent
each rank in a dispatch."""
from __future__ import annotations

from .layout import tidy


def capacity_figure(runs: dict, capacity: dict, total: int):
    """``runs``: {label: tokens each expert computed (measured, every rank's experts in order)};
    ``capacity``: {label: assignments an expert may take from all ranks, or None}; ``total``: assignments
    routed. Grouped bars, the drop rate in each label, each capacity a dotted line of its bars' colour."""
    import plotly.graph_objects as go
    from plotly.colors import DEFAULT_PLOTLY_COLORS

    fig = go.Figure()
    for (label, rows), colour in zip(runs.items(), DEFAULT_PLOTLY_COLORS):
        experts = [f"expert {e}" for e in range(len(rows))]
        dropped = 1 - sum(rows) / total
        fig.add_trace(go.Bar(name=f"{label}: {dropped:.0%} dropped", x=experts, y=rows, marker_color=colour))
        if capacity.get(label) is not None:
            fig.add_trace(go.Scatter(name=f"capacity, {label}", x=[experts[0], experts[-1]], y=[capacity[label]] * 2,
                                     mode="lines", line=dict(dash="dot", color=colour)))
    fig.update_layout(barmode="group", height=400, yaxis_title="tokens computed (measured)",
                      title="Tokens each expert computed, tokens skewed toward expert 0", legend=dict(orientation="h", y=-0.15))
    return tidy(fig)


def balance_figure(runs: dict):
    """``runs``: {label: per step, the assignments of each expert}: the busiest expert's load over the mean,
    step by step (1 is even)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, loads in runs.items():
        fig.add_trace(go.Scatter(y=[max(step) * len(step) / sum(step) for step in loads], mode="lines", name=label))
    fig.add_hline(y=1, line_dash="dot", annotation_text="even")
    fig.update_layout(height=340, xaxis_title="training step", yaxis_title="busiest expert / mean",
                      title="Load imbalance while training (measured, one process)")
    return tidy(fig)


def bytes_figure(matrix: list[list[int]], title: str):
    """``matrix[src][dst]``: bytes rank src sent rank dst, as a heat map with the numbers on it."""
    import plotly.graph_objects as go

    n = len(matrix)
    kib = [[b / 1024 for b in row] for row in matrix]
    fig = go.Figure(go.Heatmap(z=kib, x=[str(j) for j in range(n)], y=[str(i) for i in range(n)],
                               text=[[f"{v:.0f} KiB" for v in row] for row in kib], texttemplate="%{text}",
                               colorscale="Blues", colorbar=dict(title="KiB"),
                               hovertemplate="from rank %{y} to rank %{x}: %{text}<extra></extra>"))
    fig.update_layout(title=title, height=340, xaxis_title="to rank", yaxis_title="from rank",
                      yaxis_autorange="reversed")
    return tidy(fig)


def load_figure(runs: dict):
    """``runs``: {label: (CPU seconds per rank, seconds waiting in the combine per rank)}, both from the drawn
    step: grouped bars side by side. CPU time, not wall time: ranks that share cores take turns."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(1, 2, subplot_titles=("CPU time in the step, ms (measured: each rank's own work)",
                                              "waiting in the combine, ms (measured)"))
    for (label, (cpu, wait)), colour in zip(runs.items(), ("#4C78A8", "#E45756")):
        x = [f"rank {r}" for r in range(len(cpu))]
        fig.add_trace(go.Bar(name=label, x=x, y=[c * 1e3 for c in cpu], marker_color=colour, legendgroup=label), 1, 1)
        fig.add_trace(go.Bar(name=label, x=x, y=[w * 1e3 for w in wait], marker_color=colour, legendgroup=label,
                             showlegend=False), 1, 2)
    fig.update_layout(barmode="group", height=360, margin=dict(b=40), legend=dict(orientation="h", y=-0.15),
                      title="The drawn steps, rank by rank: who computed, who waited")
    return tidy(fig)
