"""Drawing a flat buffer: parameters, padding and the shard each rank owns."""
from __future__ import annotations

import plotly.graph_objects as go

from ..strategies.flat import FlatLayout
from .layout import tidy


def layout_figure(layout: FlatLayout, names=None, title=None):
    """The flat buffer as one bar: each parameter's elements in its colour, padding grey, and the
    shard boundaries as lines labelled with the rank that owns the shard."""
    names = names or [f"param {i} {tuple(s)}" for i, s in enumerate(layout.shapes)]
    fig = go.Figure()
    for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
        fig.add_bar(x=[n], base=[off], y=["flat buffer"], orientation="h", name=names[i],
                    hovertemplate=f"{names[i]}: elements {off}..{off + n - 1}<extra></extra>")
    pad = layout.padded_numel - layout.numel
    if pad:
        fig.add_bar(x=[pad], base=[layout.numel], y=["flat buffer"], orientation="h", name="padding",
                    marker_color="lightgrey", hovertemplate=f"padding: {pad} zeros<extra></extra>")
    for r in range(layout.world_size):
        start, end = layout.shard_bounds(r)
        fig.add_vline(x=start, line_color="black", line_width=2)
        fig.add_annotation(x=(start + end) / 2, y=1.0, yref="paper", yanchor="bottom", text=f"rank {r}",
                           showarrow=False)
    fig.add_vline(x=layout.padded_numel, line_color="black", line_width=2)
    fig.update_layout(barmode="overlay", height=240, margin=dict(t=70, b=40), xaxis_title="element",
                      title=title or f"{layout.numel} elements, padded to {layout.padded_numel}: "
                                     f"{layout.world_size} shards of {layout.shard_numel}",
                      legend=dict(orientation="h", y=-0.6))
    return tidy(fig)
