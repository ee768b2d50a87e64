"""Ring collectives from point-to-point messages, and how to measure any collective.

The ring (Patarasuk & Yuan, 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; used by NCCL and Horovod): rank r sends only to r+1 and receives only from r-1, and
the data is cut into N chunks.

- all-gather: N-1 steps; at step s rank r forwards chunk (r - s) and receives chunk (r - s - 1).
- reduce-scatter: N-1 steps; at step s rank r sends its partial sum of chunk (r - s - 1) and adds the
  partial sum of chunk (r - s - 2) it receives; after the last step it holds the full sum of chunk r.
- all-reduce = reduce-scatter + all-gather.

Each rank sends (N-1)/N of the data per all-gather or reduce-scatter, 2(N-1)/N per all-reduce: the
lower bound for any algorithm in which every rank must see every other rank's data, whatever N is.

Bandwidth is reported as nccl-tests does (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = S / t for a collective on S bytes (all-gather: the gathered output; reduce-scatter: the input;
all-reduce: the tensor); busbw = algbw x (N-1)/N (all-gather, reduce-scatter) or x 2(N-1)/N
(all-reduce), comparable to the link's bandwidth whatever N is.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from . import comm

OPS = ("all_gather", "reduce_scatter", "all_reduce")
BUS_FACTOR = comm.BUS_FACTOR


# -- the ring ----------------------------------------------------------------------------------------
def ring_all_gather(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (N chunks the size of ``input``) gets every rank's ``input``, in rank order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank].copy_(input.view(-1))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step) % n, (rank - step - 1) % n
        works = [comm.isend(chunks[send_c], right, name=f"step {step}: send chunk {send_c}", step=step, chunk=send_c),
                 comm.irecv(chunks[recv_c], left, name=f"step {step}: recv chunk {recv_c}", step=step, chunk=recv_c)]
        for w in works:
            w.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (one chunk) gets the sum over ranks of chunk ``rank`` of ``input`` (N chunks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    acc = input.reshape(n, -1).clone()  # partial sums, updated in place; the input stays untouched
    incoming = torch.empty_like(acc[0])
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step - 1) % n, (rank - step - 2) % n
        works = [comm.isend(acc[send_c], right, name=f"step {step}: send chunk {send_c}", step=step, chunk=send_c),
                 comm.irecv(incoming, left, name=f"step {step}: recv chunk {recv_c}", step=step, chunk=recv_c)]
        for w in works:
            w.wait()
        acc[recv_c] += incoming
    output.view(-1).copy_(acc[rank])


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over ranks in place: pad to N equal chunks, reduce-scatter, all-gather, unpad."""
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    chunk = -(-flat.numel() // n)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype, device=tensor.device)
    padded[:flat.numel()] = flat
    mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
    ring_reduce_scatter(mine, padded)
    ring_all_gather(padded, mine)
    tensor.copy_(padded[:flat.numel()].view_as(tensor))


# -- what moved where, from a real run -----------------------------------------------------------------
def transfers(timeline) -> list[list[tuple[int, int, int]]]:
    """Per step, the (src, dst, chunk) of every message the ring sent, read from a run's timeline."""
    steps: dict[int, list] = {}
    for s in timeline.spans:
        if s.meta.get("op") == "send" and "step" in s.meta:
            steps.setdefault(s.meta["step"], []).append((s.rank, s.meta["peer"], s.meta["chunk"]))
    return [sorted(steps[k]) for k in sorted(steps)]


def ring_explorer(timeline, op: str = "all_gather"):
    """A slider over the steps of a recorded ring run: who sent which chunk to whom, and what every
    rank holds afterwards (all-gather: chunks present; reduce-scatter: ranks summed into each chunk)."""
    import math

    import ipywidgets as w
    from plotly.subplots import make_subplots

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
        what = "before the first step" if k == 0 else f"step {k - 1} of {len(steps)}"
        fig.update_layout(height=360, margin=dict(t=60, b=20), title=f"ring {op.replace('_', '-')} on {n} ranks: {what}")
        out.clear_output(wait=True)
        with out:
            fig.show()

    slider.observe(lambda change: draw(change["new"]), names="value")
    draw(0)
    return w.VBox([slider, out])


# -- measuring -------------------------------------------------------------------------------------------
def sweep_sizes() -> list[int]:
    """1 KB to 64 MB in steps of 4x; up to 4 MB when LABLIB_QUICK=1 (the test suite sets it)."""
    import os

    top = 22 if os.environ.get("LABLIB_QUICK") == "1" else 26
    return [1 << k for k in range(10, top + 1, 2)]


def _time(fn, iters):
    """Per-iteration times on this rank; every iteration starts together (barrier, untraced)."""
    on_gpu = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
    times = []
    for _ in range(iters):
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def measure(size: int, iters: int = 5, ring=None, dtype=torch.float32) -> dict:
    """On every rank (inside ``cluster.run``): times of each collective on ``size`` bytes, for the ring
    (``ring``: {op: fn}, default this module's) and for torch.distributed, plus a plain memory copy."""
    from .timeline import RECORDER

    ring = ring or {"all_gather": ring_all_gather, "reduce_scatter": ring_reduce_scatter,
                    "all_reduce": ring_all_reduce}
    n = dist.get_world_size()
    dev = comm.device()
    elems = max(n, size // torch.tensor([], dtype=dtype).element_size() // n * n)  # a multiple of n
    full = torch.ones(elems, dtype=dtype, device=dev)
    part = torch.ones(elems // n, dtype=dtype, device=dev)
    plain = {"all_gather": lambda: comm.all_gather_single(full, part),
             "reduce_scatter": lambda: comm.reduce_scatter_single(part, full),
             "all_reduce": lambda: dist.all_reduce(full)}
    calls = {"all_gather": lambda f: f(full, part), "reduce_scatter": lambda f: f(part, full),
             "all_reduce": lambda f: f(full)}
    spans, RECORDER.spans = RECORDER.spans, None  # a sweep is thousands of messages: do not trace them
    try:
        out = {}
        for op in OPS:
            out[(op, "ring")] = _time(lambda: calls[op](ring[op]), iters)
            out[(op, "torch")] = _time(plain[op], iters)
        dst = torch.empty_like(full)
        out[("memcpy", "torch")] = _time(lambda: dst.copy_(full), iters)
    finally:
        RECORDER.spans = spans
    return {"bytes": full.nbytes, "times": out}


def sweep(cluster, sizes, iters: int = 5, ring=None, progress=None) -> list[dict]:
    """Measure every size on ``cluster``; one row per (size, op, implementation) with the time of the
    slowest rank (median over iterations), algbw and busbw in GB/s."""
    rows = []
    n = cluster.world_size
    for size in sizes:
        per_rank = cluster.run(measure, size, iters, ring)
        nbytes = per_rank[0]["bytes"]
        for key in per_rank[0]["times"]:
            op, impl = key
            if op == "memcpy":  # each rank copies on its own: its own time, the median over ranks
                t = statistics.median(statistics.median(r["times"][key]) for r in per_rank)
            else:  # a collective is done when its slowest rank is
                t = statistics.median(max(r["times"][key][i] for r in per_rank) for i in range(iters))
            algbw = nbytes / t / 1e9
            rows.append(dict(n=n, bytes=nbytes, op=op, impl=impl, seconds=t, algbw=algbw,
                             busbw=algbw * BUS_FACTOR[op](n)))
        if progress is not None:
            progress.value += 1
    return rows


_TABLE = [("all_gather", "ring", "ring all-gather"), ("all_gather", "torch", "torch all-gather"),
          ("reduce_scatter", "ring", "ring reduce-scatter"), ("reduce_scatter", "torch", "torch reduce-scatter"),
          ("all_reduce", "ring", "ring all-reduce"), ("all_reduce", "torch", "torch all-reduce"),
          ("memcpy", "torch", "memory copy")]


def _row(rows, op, impl, n, size):
    return next(r for r in rows if (r["op"], r["impl"], r["n"], r["bytes"]) == (op, impl, n, size))


def busbw_table(rows, size: int) -> str:
    """Bus bandwidth in GB/s at ``size`` bytes: one line per implementation, one column per world size."""
    sizes = sorted({r["n"] for r in rows})
    lines = [f"{'busbw (GB/s)':24s}" + "".join(f"{f'N={n}':>8s}" for n in sizes)]
    for op, impl, label in _TABLE:
        lines.append(f"{label:24s}" + "".join(f"{_row(rows, op, impl, n, size)['busbw']:8.2f}" for n in sizes))
    return "\n".join(lines)


def slowdown(rows, size: int, n: int, op: str = "reduce_scatter") -> float:
    """torch.distributed's time over the ring's, for ``op`` on ``size`` bytes and ``n`` ranks."""
    return _row(rows, op, "torch", n, size)["seconds"] / _row(rows, op, "ring", n, size)["seconds"]


def fit_alpha_beta(rows, op: str = "all_gather", impl: str = "ring") -> tuple[float, float]:
    """Fit t = (N-1)·α + (N-1)/N · S/β to the ring's measured times (α: seconds per step, β: bytes/s),
    by least squares on relative error so small and large messages count alike."""
    pts = [(r["n"], r["bytes"], r["seconds"]) for r in rows if r["op"] == op and r["impl"] == impl]
    if len(pts) < 2:
        raise ValueError(f"need measurements of {op} ({impl}) at two sizes at least")
    # t = a·(N-1) + b·(N-1)/N·S, weights 1/t: solve the 2x2 normal equations
    xs = [((n - 1) / t, (n - 1) / n * s / t) for n, s, t in pts]
    a11 = sum(x[0] * x[0] for x in xs)
    a12 = sum(x[0] * x[1] for x in xs)
    a22 = sum(x[1] * x[1] for x in xs)
    b1, b2 = sum(x[0] for x in xs), sum(x[1] for x in xs)
    det = a11 * a22 - a12 * a12
    alpha, inv_beta = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    return alpha, 1 / inv_beta


def predict(op: str, size: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for a ring collective on ``size`` bytes over ``n`` ranks under the α-β model."""
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * alpha + BUS_FACTOR[op](n) * size / beta


def sweep_figure(rows, metric: str = "busbw"):
    """Bandwidth against message size, one panel per collective: the ring and torch.distributed at each
    world size, with a plain memory copy as the physical reference. Log-log."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[op.replace("_", "-") for op in OPS])
    dash = {2: "solid", 3: "dot", 4: "dash"}
    color = {"ring": "#F58518", "torch": "#4C78A8", "memcpy": "#999999"}
    for col, op in enumerate(OPS, start=1):
        for impl, kind in (("ring", op), ("torch", op), ("torch", "memcpy")):
            for n in sorted({r["n"] for r in rows}):
                pts = sorted((r["bytes"], r[metric]) for r in rows if (r["impl"], r["op"], r["n"]) == (impl, kind, n))
                name = "memory copy" if kind == "memcpy" else ("ring" if impl == "ring" else "torch.distributed")
                fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                name=f"{name}, N={n}", legendgroup=f"{name}{n}", showlegend=col == 1,
                                line=dict(color=color["memcpy" if kind == "memcpy" else impl], dash=dash.get(n)),
                                marker=dict(size=5), row=1, col=col)
    fig.update_xaxes(type="log", title="bytes")
    fig.update_yaxes(type="log")
    fig.update_yaxes(title=f"{metric} (GB/s)", row=1, col=1)
    fig.update_layout(height=420, margin=dict(t=60), title=f"{metric}, measured on this machine")
    return fig


def model_figure(rows, alpha: float, beta: float, op: str = "all_gather", impl: str = "ring"):
    """Measured times against the α-β model's prediction, per world size, log-log."""
    import plotly.graph_objects as go

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
    return fig
