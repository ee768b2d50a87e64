"""Lab 04's figures: the bytes a tensor-parallel block moves (measured, beside Megatron's count) and why
tensor parallelism stays inside a node (lab 02's α-β model with stated link and GPU figures)."""
from __future__ import annotations

from .. import comm
from .layout import tidy

# Stated figures: every number here is a vendor's (datasheet) or an assumption named as one.
GPU = {"name": "H100 SXM", "flops": 989e12, "source": "datasheet: dense BF16 tensor-core peak"}
EFFICIENCY = 0.5  # assumed: large matrix multiplications reach about half the peak
TP_LINKS = {
    "NVLink": comm.Link("NVLink 4 (inside a node)", 5e-6, 450e9, "datasheet: 900 GB/s per GPU, both directions; α assumed"),
    "InfiniBand": comm.Link("InfiniBand NDR (between nodes)", 10e-6, 50e9, "datasheet: 400 Gb/s per GPU; α assumed"),
    "100GbE": comm.Link("100 Gb/s Ethernet (between nodes)", 25e-6, 12.5e9, "datasheet line rate; α assumed"),
}
DEGREES = (1, 2, 4, 8, 16, 32)


def per_layer(hidden: int, tp: int, link: str, tokens: int = 4096) -> dict:
    """One transformer layer's forward, per GPU, at tensor-parallel degree ``tp`` (modelled): Megatron's
    24·t·h² FLOPs (t tokens; attention's 4·t·s·h left out), split over ``tp`` GPUs, and its two
    all-reduces of the (t, h) BF16 activations, over ``link`` (a key of ``TP_LINKS``)."""
    chosen = TP_LINKS[link]
    flops = 24 * tokens * hidden ** 2
    nbytes = tokens * hidden * 2
    return {"flops": flops, "bytes": 2 * nbytes, "link": chosen,
            "compute": flops / tp / (GPU["flops"] * EFFICIENCY),
            "comm": 2 * chosen.seconds("all_reduce", nbytes, tp) if tp > 1 else 0.0}


def cost_figure(hidden: int = 8192, link: str = "NVLink", tokens: int = 4096):
    """Compute and communication time per layer against the tensor-parallel degree (modelled)."""
    import plotly.graph_objects as go

    rows = [per_layer(hidden, n, link, tokens) for n in DEGREES]
    x = [str(n) for n in DEGREES]
    fig = go.Figure([
        go.Bar(name="compute", x=x, y=[r["compute"] * 1e3 for r in rows], marker_color="#4C78A8"),
        go.Bar(name="all-reduces (exposed)", x=x, y=[r["comm"] * 1e3 for r in rows], marker_color="#E45756"),
    ])
    worse = next((n for n, r in zip(DEGREES, rows) if r["comm"] > r["compute"]), None)
    link_ = TP_LINKS[link]
    fig.add_vline(x=3.5, line_dash="dot", line_color="#888")  # between TP 8 and TP 16
    fig.add_annotation(x=3.5, y=1, yref="paper", text="one node: 8 GPUs ", showarrow=False, xanchor="right",
                       yanchor="top", font=dict(size=11, color="#666"))
    fig.update_layout(
        barmode="group", height=460, margin=dict(t=150, b=40),
        title=(f"One layer's forward per GPU (modelled): hidden {hidden}, {tokens} tokens, {link_.name}<br><sup>"
               + (f"communication exceeds compute from TP {worse}" if worse else "compute exceeds communication "
                  "at every degree shown")
               + f"<br>compute: {GPU['name']} at {EFFICIENCY:.0%} (assumed) of {GPU['flops'] / 1e12:.0f} TFLOP/s "
               f"({GPU['source']})<br>link: {link_}</sup>"),
        xaxis_title="tensor-parallel degree (GPUs per layer)", yaxis_title="ms per layer (forward)")
    return tidy(fig)


def cost_explorer():
    """``cost_figure`` with controls for the hidden size, the link and the tokens per micro-batch."""
    import ipywidgets as widgets

    return widgets.interactive(
        lambda hidden, link, tokens: cost_figure(hidden, link, tokens).show(),
        hidden=widgets.SelectionSlider(options=[1024, 2048, 4096, 8192, 12288, 16384], value=8192,
                                       description="hidden"),
        link=widgets.Dropdown(options=list(TP_LINKS), value="NVLink", description="link"),
        tokens=widgets.SelectionSlider(options=[1024, 2048, 4096, 8192, 16384], value=4096, description="tokens"))


def traffic(timeline, tokens: int, width: int, steps: int) -> dict:
    """Bytes per token per block (forward and backward) of a tensor-parallel run: the collectives'
    payload as traced, Megatron's count (4 all-reduces of the (tokens, width) fp32 activations), and
    the bytes each rank wrote to its sockets (measured by the kernel) beside the ring's 2(n-1)/n."""
    n = timeline.world_size
    comms = [s for s in timeline.spans if s.kind == "comm" and s.rank == 0]
    payload = sum(s.bytes or 0 for s in comms) / steps / tokens
    wire = comm.bytes_on_wire(timeline)
    return {"ranks": n, "payload": payload, "formula": 4 * width * 4,
            "wire": None if wire is None else wire / steps / tokens,
            "ring": 4 * width * 4 * 2 * (n - 1) / n}


def _ms(median: float, spread: tuple) -> str:
    return f"{median * 1e3:6.1f} ms ({spread[0] * 1e3:.1f}–{spread[1] * 1e3:.1f})"


def step_table(runs: dict, tokens: int, width: int) -> str:
    """Lab 04's measured table: per degree the step (median of the timed steps, and their range) beside
    DTensor's, and the bytes per token: the payload traced, Megatron's count, the bytes each rank wrote
    to its sockets and the ring's 2(n-1)/n of the payload."""
    lines = [f"measured on this machine: median of {next(iter(runs.values()))['steps']} steps (their range)"]
    if any(r.get("apart") for r in runs.values()):
        lines.append("(your block computed on the GPU, DTensor's on the CPU: Gloo, which carries the ranks' "
                     "collectives here, takes no CUDA tensors for DTensor's, so the two are not like for like)")
    for n, r in runs.items():
        t = traffic(r["timeline"], tokens, width, r["steps"])
        wire = "   n/a" if t["wire"] is None else f"{t['wire']:6.0f}"
        lines.append(f"TP {n}: step {_ms(r['step'], r['range'])}, DTensor {_ms(r['dtensor'], r['dtensor_range'])} | "
                     f"per token and step: payload {t['payload']:5.0f} B (formula {t['formula']}), sent per rank "
                     f"{wire} B (ring {t['ring']:.0f})")
    return "\n".join(lines)
