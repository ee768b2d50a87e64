"""Figures and widgets for lab 02: the ring explorer, bandwidth sweeps and the α-β model."""
from __future__ import annotations

import math

import ipywidgets as w
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..bandwidth import OPS, predict
from ..strategies.ring import transfers
from .layout import tidy


def ring_explorer(timeline, op: str = "all_gather"):
    """A slider over the steps of a recorded ring run: who sent which chunk to whom, and what every
    rank holds afterwards (all-gather: chunks present; reduce-scatter: ranks summed into each chunk)."""
    n, steps = timeline.world_size, transfers(timeline)
    # Replay the recorded messages: state[r][c] = set of ranks whose data chunk c on rank r contains.
    state = [[({r} if (op == "reduce_scatter" or c == r) else set()) for c in range(n)] for r in range(n)]
    history = [[[set(x) for x in row] for row in state]]
    for moves in steps:
        new = [[set(x) for x in row] for row in state]
        for src, dst, c in moves:
            new[dst][c] = state[dst][c] | state[src][c]
        state = new
        history.append([[set(x) for x in row] for row in state])
    xy = [(math.cos(math.pi / 2 - 2 * math.pi * r / n), math.sin(math.pi / 2 - 2 * math.pi * r / n)) for r in range(n)]
    slider = w.IntSlider(value=0, min=0, max=len(steps), description="step", continuous_update=True)
    out = w.Output()

    def draw(k):
        fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55],
                            subplot_titles=("messages of this step", "what each rank holds after it"))
        fig.add_scatter(x=[p[0] for p in xy], y=[p[1] for p in xy], mode="markers+text", row=1, col=1,
                        text=[f"rank {r}" for r in range(n)], textposition="middle center",
                        marker=dict(size=46, color="#E8EEF7", line=dict(width=1, color="#4C78A8")), showlegend=False)
        for src, dst, c in (steps[k - 1] if k else []):
            (x0, y0), (x1, y1) = xy[src], xy[dst]
            fig.add_annotation(x=x1 * 0.75 + x0 * 0.25, y=y1 * 0.75 + y0 * 0.25, ax=x0 * 0.75 + x1 * 0.25,
                               ay=y0 * 0.75 + y1 * 0.25, xref="x1", yref="y1", axref="x1", ayref="y1",
                               arrowhead=3, arrowwidth=2, arrowcolor="#F58518", text=f"chunk {c}",
                               font=dict(color="#F58518"))
        held = history[k]
        z = [[len(held[r][c]) for c in range(n)] for r in range(n)]
        label = [[("✓" if held[r][c] else "") if op == "all_gather" else f"{len(held[r][c])}/{n}" for c in range(n)]
                 for r in range(n)]
        fig.add_heatmap(z=z, x=[f"chunk {c}" for c in range(n)], y=[f"rank {r}" for r in range(n)], zmin=0, zmax=n,
                        colorscale="Blues", showscale=False, text=label, texttemplate="%{text}", row=1, col=2)
        fig.update_xaxes(visible=False, range=[-1.5, 1.5], row=1, col=1)
        fig.update_yaxes(visible=False, range=[-1.5, 1.5], scaleanchor="x", row=1, col=1)
        fig.update_yaxes(autorange="reversed", row=1, col=2)
        what = "before the first step" if k == 0 else f"after step {k} of {len(steps)} (s = {k - 1} in the text)"
        fig.update_layout(height=360, margin=dict(t=60, b=20), title=f"ring {op.replace('_', '-')} on {n} ranks: {what}")
        out.clear_output(wait=True)
        with out:
            tidy(fig).show()

    slider.observe(lambda change: draw(change["new"]), names="value")
    draw(0)
    return w.VBox([slider, out])


def sweep_figure(rows, metric: str = "busbw"):
    """Bandwidth against message size, one panel per collective: the ring and torch.distributed at each
    world size, with a plain memory copy as the physical reference. Log-log."""
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[op.replace("_", "-") for op in OPS])
    dash = {2: "solid", 3: "dot", 4: "dash"}
    color = {"ring": "#F58518", "torch": "#4C78A8", "memcpy": "#999999"}
    for col, op in enumerate(OPS, start=1):
        for impl, kind in (("ring", op), ("torch", op), ("torch", "memcpy")):
            for n in sorted({r["n"] for r in rows}):
                mine = [r for r in rows if (r["impl"], r["op"], r["n"]) == (impl, kind, n)]
                pts = sorted((r["bytes"], r[metric]) for r in mine)
                whose = f" ({mine[0]['whose']})" if mine and mine[0].get("whose") else ""
                name = "memory copy" if kind == "memcpy" else (f"ring{whose}" if impl == "ring" else "torch.distributed")
                fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                name=f"{name}, N={n}", legendgroup=f"{name}{n}", showlegend=col == 1 or impl == "ring",
                                line=dict(color=color["memcpy" if kind == "memcpy" else impl], dash=dash.get(n)),
                                marker=dict(size=5), row=1, col=col)
    fig.update_xaxes(type="log", title="bytes")
    fig.update_yaxes(type="log")
    fig.update_yaxes(title=f"{metric} (GB/s)", row=1, col=1)
    fig.update_layout(height=420, margin=dict(t=60), title=f"{metric}, measured on this machine")
    return tidy(fig)


def model_figure(rows, alpha: float, beta: float, op: str = "all_gather", impl: str = "ring"):
    """Measured times against the α-β model's prediction, per world size, log-log."""
    fig = go.Figure()
    for n in sorted({r["n"] for r in rows}):
        pts = sorted((r["bytes"], r["seconds"]) for r in rows if r["op"] == op and r["impl"] == impl and r["n"] == n)
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] * 1e3 for p in pts], mode="markers", name=f"measured, N={n}",
                        marker=dict(size=9))
        fig.add_scatter(x=[p[0] for p in pts], y=[predict(op, p[0], n, alpha, beta) * 1e3 for p in pts],
                        mode="lines", name=f"model, N={n}")
    fig.update_xaxes(type="log", title="message size (bytes)")
    fig.update_yaxes(type="log", title="time (ms)")
    fig.update_layout(height=420, margin=dict(t=50), title=f"ring {op.replace('_', '-')}: "
                      f"α = {alpha * 1e6:.0f} µs per step, β = {beta / 1e9:.2f} GB/s")
    return tidy(fig)
