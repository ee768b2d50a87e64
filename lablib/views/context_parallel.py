"""Lab 06's figures and printed lines: each rank's attention work and CPU time, contiguous against zig-zag;
the activation memory a rank holds against the sequence length at 1, 2 and 4 ranks; what the ring's sends
took; the ring, all-to-all and all-gather attention side by side; and the backend every measurement ran on."""
from __future__ import annotations

import statistics

from .layout import backend, log_ticks, measured, on_gpu, tidy  # noqa: F401 (view.backend, view.measured)

# One hue per P, shared by that P's two lines (what autograd keeps, what recomputation keeps)
P_COLOURS = {1: "#4C78A8", 2: "#F58518", 4: "#54A24B", 8: "#B279A2"}


def sends(seconds: list[float], cluster) -> str:
    """One line on the sends of a drawn timeline (``strategies.context_parallel.transfer_seconds``)."""
    if not seconds:
        return "no sends in this timeline"
    ms = sorted(s * 1e3 for s in seconds)
    return (f"a K/V chunk's send took {statistics.median(ms):.1f} ms, the median of the {len(ms)} sends drawn below "
            f"({ms[0]:.1f} to {ms[-1]:.1f} ms; {measured(cluster)}, posted to delivered)")


def clock(cluster) -> str:
    """ "CPU time" (or "GPU time"): what a rank's time in attention was measured by on this cluster."""
    return "GPU time" if on_gpu(cluster) else "CPU time"


def spread(runs: dict, cluster=None) -> str:
    """``runs`` as for ``work_figure``: per layout, the busiest rank's work and time over the least busy's."""
    time = clock(cluster)
    parts = [f"{layout}: work {max(w) / min(w):.1f}x, {time} {max(c) / min(c):.1f}x"
             for layout, (w, c) in runs.items() if min(w) > 0 and min(c) > 0]
    return f"busiest rank over least busy (work counted, {time} in attention measured): " + "; ".join(parts)


def work_figure(runs: dict, cluster=None):
    """``runs``: {layout: (per-rank work, per-rank seconds in attention)}: two bar charts side by side. CPU time
    on the CPU, not the timeline's wall time: ranks that share cores take turns, and wall time would show the
    turns; on a GPU, the rank's kernels' time (``strategies.context_parallel``)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    how = measured(cluster) if cluster is not None else "measured"
    fig = make_subplots(1, 2, subplot_titles=("attention work (query-key pairs, counted)",
                                              f"{clock(cluster)} in attention, ms ({how}; median of the runs)"))
    colours = {"contiguous": "#E45756", "zigzag": "#4C78A8"}
    for layout, (work, seconds) in runs.items():
        x = [f"rank {r}" for r in range(len(work))]
        fig.add_trace(go.Bar(name=layout, x=x, y=work, marker_color=colours.get(layout), legendgroup=layout), 1, 1)
        fig.add_trace(go.Bar(name=layout, x=x, y=[s * 1e3 for s in seconds], marker_color=colours.get(layout),
                             legendgroup=layout, showlegend=False), 1, 2)
    fig.update_layout(barmode="group", height=360, margin=dict(b=40), legend=dict(orientation="h", y=-0.15),
                      title="Causal ring attention: each rank's share of the work")
    return tidy(fig)


def memory_figure(rows: list[dict]):
    """``rows``: {"P", "tokens", "saved", "kept"}: activation bytes per rank against the sequence length,
    one hue per P (measured: what autograd keeps through the ring, solid; what Task 6.3's recompute keeps,
    counted, dotted)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for p in sorted({r["P"] for r in rows}):
        mine = [r for r in rows if r["P"] == p]
        colour = P_COLOURS.get(p)
        for key, what, dash, symbol in (("saved", "autograd keeps (measured)", "solid", "circle"),
                                        ("kept", "recompute from lse keeps (counted)", "dot", "diamond-open")):
            fig.add_trace(go.Scatter(x=[r["tokens"] for r in mine], y=[r[key] / 2**20 for r in mine],
                                     mode="lines+markers", name=f"P = {p}: {what}", legendgroup=f"P{p}",
                                     line=dict(color=colour, dash=dash), marker=dict(color=colour, symbol=symbol)))
    values = [r[k] / 2**20 for r in rows for k in ("saved", "kept")]
    fig.update_yaxes(type="log", title="MiB per rank (log scale)", **log_ticks(values))
    fig.update_xaxes(title="sequence length (tokens)", tickvals=sorted({r["tokens"] for r in rows}))
    fig.update_layout(title="Activation memory per rank for one attention layer", height=420)
    return tidy(fig)


def three_ways(rows: list[dict], cluster) -> str:
    """A table of ``strategies.context_parallel.three_ways``: bytes rank 0 sent (measured, and the formula),
    the K/V a rank holds (counted) and the share of communication hidden under attention (measured)."""
    lines = [f"{'':11}{'sent by rank 0, MiB':>22}{'by formula':>12}{'K/V held, MiB':>15}{'hidden/comm':>12}",
             f"{'':11}{'(' + measured(cluster) + ')':>22}{'':>12}{'(counted)':>15}{'(measured)':>12}"]
    for r in rows:
        lines.append(f"{r['way']:11}{r['sent'] / 2**20:22.2f}{r['formula'] / 2**20:12.2f}{r['held'] / 2**20:15.2f}"
                     f"{r['hidden']:12.0%}")
    return "\n".join(lines)
