"""What every lablib figure's layout shares: the title clear of plotly's toolbar, and plain numbers on log axes.

Plotly draws its toolbar (the modebar: zoom, pan, download) in the figure's top right corner, 2 to 25 px from
the top, over whatever is there; a title at plotly's default place, 10 to 30 px from the top, runs under it
as soon as it is long. ``tidy(fig)`` puts the title in a band of its own below the toolbar and makes the top
margin hold it, the subplot titles under it and whatever the figure puts between them (a legend), also where
the figure set a smaller margin of its own. On a log axis plotly writes 1e+06 or 1M, and a B that reads as
bytes means billions; ``tidy`` has it write 1,000,000, and ``log_ticks`` gives ticks at 1, 3, 10, 30, ...
for an axis with few decades.

Every figure a lablib view returns goes through ``tidy`` (``return tidy(fig)``)."""
from __future__ import annotations

MODEBAR = 34  # px from the figure's top kept for the toolbar (2-25 px) and a gap under it
LINE = 22     # px one line of a title takes (plotly's 17 px title font)
LIFT = 12     # px plotly draws a title of two lines or more higher than its anchor (measured in Chromium)
GAP = 10      # px between the title band and what is under it


def _lines(text: str | None) -> int:
    return (text.count("<br>") + 1) if text else 0


def _subplot_titles(fig) -> bool:
    """Whether annotations sit on top of the plots, as make_subplots' subplot titles do."""
    return any(a.yref == "paper" and (a.y or 0) >= 0.99 and a.yanchor == "bottom" for a in fig.layout.annotations)


def tidy(fig, above: int = 0):
    """``fig`` with its title under the toolbar and a top margin that holds the title, the subplot titles and
    ``above`` px more (a legend the figure puts over its plots), and plain numbers on its log axes. Keeps a
    larger margin the figure set itself; idempotent."""
    lines = _lines(fig.layout.title.text)
    need = MODEBAR + LINE * lines + (LINE if _subplot_titles(fig) else 0) + above + GAP
    top = fig.layout.margin.t
    fig.update_layout(margin_t=max(top if top is not None else 100, need))
    if lines:
        fig.update_layout(title=dict(yref="container", y=1, yanchor="top", pad_t=MODEBAR + (LIFT if lines > 1 else 0)))
    for axis in [k for k in fig.layout if k.startswith(("xaxis", "yaxis"))]:
        if fig.layout[axis].type == "log":
            fig.layout[axis].update(exponentformat="none", separatethousands=True)
    return fig


def log_ticks(values, steps=(1, 3)) -> dict:
    """Ticks for a log axis spanning ``values``, as plain numbers: 1, 3, 10, 30, ... (``steps`` in a decade),
    for ``fig.update_yaxes(type="log", **log_ticks(values))``. Plotly's own ticks on an axis of a decade or
    two are sparse; on many decades keep them (``tidy`` writes them plainly)."""
    import math

    low, high = min(v for v in values if v > 0), max(values)
    ticks = [t for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
             for t in (float(f"{s}e{e}") for s in steps) if low / steps[-1] <= t <= high * steps[-1]]
    return dict(tickvals=ticks, ticktext=[f"{t:,.12g}" for t in ticks])


def backend(cluster) -> str:
    """The backend the cluster's collectives ran on, as a label says it: "Gloo" or "NCCL"."""
    return {"nccl": "NCCL", "gloo": "Gloo"}.get(str(cluster.backend).lower(), str(cluster.backend))


def on_gpu(cluster) -> bool:
    """Whether the cluster's ranks computed on GPUs."""
    return getattr(cluster, "device", "cpu") == "cuda"


def measured(cluster) -> str:
    """ "measured, Gloo" (or NCCL, and "GPU" where the ranks computed on one): what a label says of a number
    taken on this cluster."""
    return f"measured, {backend(cluster)}" + (", GPU" if on_gpu(cluster) else "")
