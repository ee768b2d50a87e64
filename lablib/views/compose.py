"""Lab 08's figures: a composed step's timeline with each axis's collectives in their own colour, and the
planner's layouts (memory per GPU against step time)."""
from __future__ import annotations

import dataclasses

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..strategies import compose as cp
from ..strategies.planner import describe
from ..timeline import Span, Timeline
from .layout import tidy
from .timeline import OPS


def by_axis(timeline, shape):
    """A copy of ``timeline`` whose all-reduces and broadcasts are named and coloured by the axis of their
    group (tp, dp, pp) on the mesh of sizes ``shape`` = (pp, dp, tp)."""
    spans = []
    for s in timeline.spans:
        op, group = s.meta.get("op"), s.meta.get("group")
        if s.kind == "comm" and op in ("all_reduce", "broadcast") and group is not None:
            axis = next((a for a in cp.AXES if cp.axis_ranks(s.rank, shape, a) == group), None)
            if axis and f"{axis}_{op}" in OPS:
                s = dataclasses.replace(s, name=f"{axis} {s.name}", meta={**s.meta, "op": f"{axis}_{op}"})
        spans.append(s)
    return Timeline(spans, timeline.world_size, timeline.clock_error, timeline.title)


def modelled_timeline(shape, size: dict, compute: float, link) -> Timeline:
    """The planner's step (``compose.modelled``) drawn as a timeline: each stage's forwards and backwards where
    lab 05's simulator puts them under 1F1B, each lasting its share of the compute and of the all-reduces and
    sends of a micro-batch (a forward a third of the compute), then the gradients' all-reduce; modelled."""
    from ..checks import answers
    from ..strategies.schedules import simulate

    terms, m, pp = cp.modelled(shape, size, compute, link), size["micro_batches"], shape[0]
    comm = (terms["tp"] + terms["pp"]) / m / 2                  # a micro-batch's, half in each direction
    times = {"F": terms["compute"] / m / 3 + comm, "BW": terms["compute"] / m * 2 / 3 + comm}
    runs = simulate(answers("lab05").one_f_one_b(pp, m), times)
    spans = []
    for rank in range(4):
        stage = cp.coords(rank, shape)["pp"]
        for a, t0, t1 in runs[stage]:
            spans.append(Span(rank, f"{a.kind}{a.mb}", "compute", t0, t1,
                              meta={"op": "forward" if a.kind == "F" else "backward", "label": f"{a.kind}{a.mb}"}))
        end = max(t1 for run in runs for _, _, t1 in run)
        if terms["dp"]:
            spans.append(Span(rank, "dp all_reduce (modelled)", "comm", end, end + terms["dp"],
                              meta={"op": "dp_all_reduce"}))
    return Timeline(spans, 4, title="modelled")


def plan_figure(plans: dict):
    """One panel per model: a point per layout, memory per GPU (GB) against modelled step time (s), those
    that fit filled, the planner's pick a star. ``plans``: {title: (rows, memory limit in bytes)}."""
    fig = make_subplots(rows=1, cols=len(plans), subplot_titles=list(plans), horizontal_spacing=0.07)
    ticks = [v * 10 ** e for e in range(-1, 5) for v in (1, 2, 5)]
    shown = set()  # each legend entry once
    for col, (title, (rows, limit)) in enumerate(plans.items(), start=1):
        pick = next((r for r in rows if r["fits"]), None)
        for fits, name, symbol in ((True, "fits", "circle"), (False, "does not fit", "circle-open")):
            pts = [r for r in rows if r["fits"] == fits and r is not pick]
            fig.add_trace(go.Scattergl(
                x=[r["total"] for r in pts], y=[r["memory"] / 1e9 for r in pts], mode="markers", name=name,
                marker=dict(symbol=symbol, size=6, color="#0072B2" if fits else "#999999"),
                text=[f"{describe(r['layout'])}<br>{r['memory'] / 1e9:.1f} GB, {r['total']:.2f} s" for r in pts],
                hovertemplate="%{text}<extra></extra>", legendgroup=name, showlegend=bool(pts) and name not in shown),
                row=1, col=col)
            shown |= {name} if pts else set()
        if pick:
            fig.add_trace(go.Scatter(x=[pick["total"]], y=[pick["memory"] / 1e9], mode="markers", name="the pick",
                                     marker=dict(symbol="star", size=14, color="#D55E00"),
                                     text=[describe(pick["layout"])], hovertemplate="%{text}<extra></extra>",
                                     legendgroup="pick", showlegend="pick" not in shown), row=1, col=col)
            shown.add("pick")
        fig.add_hline(y=limit / 1e9, line=dict(dash="dot", color="#D55E00"), row=1, col=col)
        fig.update_xaxes(title_text="step time, s (modelled)", type="log", tickvals=ticks, ticktext=[f"{v:g}" for v in ticks],
                         row=1, col=col)
        fig.update_yaxes(title_text="memory per GPU, GB (modelled)" if col == 1 else None, type="log", tickvals=ticks,
                         ticktext=[f"{v:g}" for v in ticks], row=1, col=col)
    fig.update_layout(height=420, title="Every valid layout: memory per GPU against step time (modelled; dotted: "
                      "the memory a layout may use)", plot_bgcolor="white")
    return tidy(fig)


def plan_table(rows: list[dict], count: int = 5) -> str:
    """The ``count`` fastest layouts that fit, with their memory, the terms of their step time and its MFU."""
    lines = [f"{'layout':62} {'memory GB':>9} {'step s':>7} {'compute s':>9} {'TP s':>6} {'CP s':>6} {'bubble s':>8} "
             f"{'DP s':>6} {'MFU %':>6}"]
    for r in [r for r in rows if r["fits"]][:count]:
        lines.append(f"{describe(r['layout']):62} {r['memory'] / 1e9:9.1f} {r['total']:7.2f} {r['compute']:9.2f} "
                     f"{r['tp']:6.2f} {r['cp']:6.2f} {r['bubble']:8.2f} {r['dp']:6.2f} {100 * r['mfu']:6.1f}")
    return "\n".join(lines)


def gap_table(rows: dict) -> str:
    """``planner.against_published``'s rows: each layout's modelled terms and MFU beside Llama 3's published MFU,
    the step it implies and the seconds in none of the model's terms."""
    lines = [f"{'Llama 3 405B':18} {'compute s':>9} {'TP s':>5} {'CP s':>5} {'bubble s':>8} {'DP s':>5} {'step s':>7} "
             f"{'MFU %':>6} | {'published MFU %':>15} {'its step s':>10} {'in no term s':>12}"]
    for title, r in rows.items():
        lines.append(f"{title:18} {r['compute']:9.2f} {r['tp']:5.2f} {r['cp']:5.2f} {r['bubble']:8.2f} {r['dp']:5.2f} "
                     f"{r['total']:7.2f} {100 * r['mfu']:6.1f} | {100 * r['published']:15.0f} {r['their_step']:10.2f} "
                     f"{r['missing']:6.2f} ({r['missing'] / r['their_step']:.0%})")
    return "\n".join(lines)
