"""Bytes per rank: measured from the tensors a rank holds, the ZeRO paper's formulas beside them, and
an extrapolation to real model sizes."""
from __future__ import annotations

import torch

KINDS = ("params", "grads", "optimizer")
KIND_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B"}
STAGE_NAMES = {"dp": "replicated DP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 / FSDP"}


def storage_bytes(tensors) -> dict[str, int]:
    """Bytes by kind of ``(kind, tensor)`` pairs, each storage counted once (for the first kind that
    names it): a view (a module parameter inside a flat buffer) costs nothing extra, a freed buffer 0.
    Non-tensors are skipped; a DTensor counts its local shard."""
    seen, out = set(), dict.fromkeys(KINDS, 0)
    for kind, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()
    return out


def held_bytes(units) -> dict[str, int]:
    """Bytes of the tensors a rank holds between steps in our strategies, by kind."""
    def tensors():
        for u in units:
            yield from (("params", u.flat), ("params", u.shard))
            for p in u.module.parameters():
                yield from (("params", p), ("grads", p.grad))
            yield from (("grads", u.grad), ("optimizer", u.master))
            yield from (("optimizer", t) for t in u.state.values())

    return storage_bytes(tensors())


def zero_formula(stage: str, psi: float, n: int, mixed: bool = True, state_bytes: int = 8) -> dict[str, float]:
    """The ZeRO paper's bytes per rank, by kind, for ``psi`` parameters on ``n`` ranks.

    Adam in mixed precision: 2 + 2 + 12 bytes per parameter (fp16/bf16 parameters and gradients; fp32
    master copy, momentum and variance): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N. In fp32: 4 + 4 + 8.
    ``state_bytes``: the optimizer's fp32 state per parameter (Adam 8, SGD with momentum 4)."""
    p, g, o = (2, 2, state_bytes + 4) if mixed else (4, 4, state_bytes)
    split = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}[stage]
    return {"params": p * psi / split[0], "grads": g * psi / split[1], "optimizer": o * psi / split[2]}


def fit_per_parameter(measured: dict) -> dict[str, tuple[float, float]]:
    """From ``{(stage, n): (bytes, psi)}`` at two or more world sizes, fit bytes/Ψ = a + b/N per stage.

    ``a`` is what every rank keeps whole, ``b`` what is split; the calculator extrapolates with them."""
    out = {}
    for stage in sorted({s for s, _ in measured}, key=lambda s: list(STAGE_NAMES).index(s)):
        pts = [(n, b / psi) for (s, n), (b, psi) in measured.items() if s == stage]
        if len(pts) < 2:
            raise ValueError(f"{stage}: measure at least two world sizes to separate a from b/N")
        # least squares on y = a + b * (1/N)
        xs = [1 / n for n, _ in pts]
        ys = [y for _, y in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        out[stage] = (my - b * mx, b)
    return out


def memory_figure(rows, title="Bytes each rank holds between steps (measured) vs the ZeRO formulas"):
    """Stacked bars, one per row: ``rows`` are dicts with params, grads, optimizer (measured bytes),
    formula (bytes), and the two-level label ``group`` / ``label`` (e.g. "ZeRO-2" / "N=4")."""
    import plotly.graph_objects as go

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
    return fig


def calculator(coefficients: dict[str, tuple[float, float]]):
    """Sliders (model size, GPUs, memory per GPU) over bytes/Ψ = a + b/N fitted from measurements:
    which strategies fit a real model, ignoring activations and buffers. Returns the widget."""
    import ipywidgets as w
    import plotly.graph_objects as go

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
            figure.show()
        ok = [STAGE_NAMES[s] for s, f in zip(stages, fits) if f]
        verdict.value = ("fits: " + ", ".join(ok)) if ok else "fits with none of these: shard over more GPUs"

    for control in (size, gpus, capacity):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([size, gpus, capacity]), verdict, out])
