"""Figures and widgets for lab 01: bytes per rank against the ZeRO formulas, and a calculator that
extrapolates the measured coefficients to real model sizes."""
from __future__ import annotations

import ipywidgets as w
import plotly.graph_objects as go

from ..memory import KINDS, STAGE_NAMES
from .layout import tidy

KIND_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B"}


def memory_figure(rows, title="Bytes each rank holds between steps (measured) vs the ZeRO formulas"):
    """Stacked bars, one per row: ``rows`` are dicts with params, grads, optimizer (measured bytes),
    formula (bytes), and the two-level label ``group`` / ``label`` (e.g. "ZeRO-2" / "N=4")."""
    x = [[r["group"] for r in rows], [r["label"] for r in rows]]
    fig = go.Figure()
    for kind in KINDS:
        fig.add_bar(name=kind, x=x, y=[r[kind] / 1e3 for r in rows], marker_color=KIND_COLORS[kind],
                    hovertemplate=f"{kind}: %{{y:.2f}} KB<extra></extra>")
    fig.add_scatter(name="ZeRO formula", x=x, y=[r["formula"] / 1e3 for r in rows], mode="markers",
                    marker=dict(symbol="line-ew-open", size=28, color="black", line=dict(width=3)),
                    hovertemplate="formula: %{y:.2f} KB<extra></extra>")
    fig.update_layout(barmode="stack", title=title, yaxis_title="KB per rank", height=420,
                      legend=dict(orientation="h", y=-0.25), margin=dict(t=50, b=40))
    return tidy(fig)


def calculator(coefficients: dict[str, tuple[float, float]]):
    """Sliders (model size, GPUs, memory per GPU) over bytes/Ψ = a + b/N fitted from measurements:
    which strategies fit a real model, ignoring activations and buffers. Returns the widget."""
    size = w.FloatLogSlider(value=7, base=10, min=-1, max=3, step=0.01, description="params (B)",
                            readout_format=".3g", continuous_update=False)
    gpus = w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], value=8, description="GPUs",
                             continuous_update=False)
    capacity = w.SelectionSlider(options=[16, 24, 40, 48, 80, 96, 141, 192], value=80, description="GB per GPU",
                                 continuous_update=False)
    stages = [s for s in STAGE_NAMES if s in coefficients]
    out = w.Output()  # a plain figure redrawn in an Output: core widgets only, so it works in Colab too
    verdict = w.HTML()

    def gb(stage):  # (a + b/N) bytes per parameter, times billions of parameters = GB
        a, b = coefficients[stage]
        return (a + b / gpus.value) * size.value

    def redraw(*_):
        vals = [gb(s) for s in stages]
        fits = [v <= capacity.value for v in vals]
        figure = go.Figure(go.Bar(x=[STAGE_NAMES[s] for s in stages], y=vals,
                                  marker_color=["#54A24B" if f else "#E45756" for f in fits],
                                  text=[f"{v:,.1f} GB" for v in vals], textposition="outside"))
        figure.add_hline(y=capacity.value, line_dash="dash", annotation_text=f"{capacity.value} GB per GPU")
        figure.update_layout(title=f"{size.value:.3g}B parameters on {gpus.value} GPUs: model state per GPU",
                             yaxis_title="GB per GPU", height=380, margin=dict(t=50, b=40),
                             yaxis_range=[0, max(max(vals), capacity.value) * 1.15])
        out.clear_output(wait=True)
        with out:
            tidy(figure).show()
        ok = [STAGE_NAMES[s] for s, f in zip(stages, fits) if f]
        verdict.value = ("fits: " + ", ".join(ok)) if ok else "fits with none of these: shard over more GPUs"

    for control in (size, gpus, capacity):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([size, gpus, capacity]), verdict, out])
