"""Figures for lab 03: what prefetching deeper costs in memory against what it saves in step time."""
from __future__ import annotations

import plotly.graph_objects as go
from .layout import tidy


def depth_figure(rows, link=None):
    """One point per depth: ``rows`` are dicts with depth, peak (bytes of full parameters a rank held at
    once, counted from their storage), step (seconds) and hidden (fraction of communication under
    compute). ``link``: the simulated link the steps ran over (None: the real one), named on the axis."""
    timing = f"compute measured, {link.name} simulated" if link is not None else "measured"
    fig = go.Figure(go.Scatter(
        x=[r["peak"] / 1e6 for r in rows], y=[r["step"] * 1e3 for r in rows], mode="lines+markers+text",
        text=[f"depth {r['depth']}" for r in rows], textposition="top center", marker=dict(size=12, color="#0072B2"),
        customdata=[[r["hidden"]] for r in rows],
        hovertemplate="peak %{x:.2f} MB, step %{y:.1f} ms, %{customdata[0]:.0%} of comm hidden<extra></extra>"))
    fig.update_layout(title=f"Prefetch depth: memory held against step time ({timing})",
                      xaxis_title="peak full parameters held per rank (MB, measured)",
                      yaxis_title="step time (ms)", height=380, margin=dict(t=50, b=40),
                      plot_bgcolor="white")
    # x starts a little left of 0, so its "0" is not printed over the y axis's "0" at the corner
    most = max((r["peak"] / 1e6 for r in rows), default=1.0) or 1.0
    fig.update_xaxes(showgrid=True, gridcolor="#EEEEEE", range=[-0.04 * most, 1.12 * most])
    fig.update_yaxes(showgrid=True, gridcolor="#EEEEEE", rangemode="tozero")
    return tidy(fig)


def step_lines(runs: dict, how: str) -> str:
    """One line per run of ``prefetch.measure`` (or ``prefetch.versus_fsdp2``): the median step, its range
    over the timed steps, and (where measured) the share of the last step's communication that ran under
    compute. ``how``: what was measured ("measured, Gloo"; "simulated link")."""
    lines = []
    for name, m in runs.items():
        lo, hi = m["range"]
        hidden = f"{m['hidden']:4.0%} of the last step's communication under compute " if "hidden" in m else ""
        lines.append(f"{name:18s} step {m['step'] * 1e3:6.1f} ms (median of {m['steps']}, {lo * 1e3:.1f}–{hi * 1e3:.1f}), "
                     f"{hidden}({how})")
    return "\n".join(lines)
