"""Lab 05's views: a schedule drawn as planned (unit times, no ranks), measured runs of the schedules
on the ranks one above the other, and the measured bubble beside the papers' formula."""
from __future__ import annotations

from ..overlap import intersect, length, union
from ..strategies import schedules as sc
from ..strategies import pp_reference as ref
from ..timeline import Span, Timeline, compare


def plan_figure(schedule, v: int = 1, title: str = "", split: bool | None = None):
    """The schedule as the simulator runs it (F = 1, B = 2, or B = W = 1 when it has W actions), per rank
    on one axis: planned, not measured."""
    acts = sc.as_actions(schedule)
    runs = sc.simulate(acts, {k: t / v for k, t in {"F": 1, "BW": 2, "B": 1, "W": 1}.items()}, v)
    op = {"F": "forward", "B": "backward", "W": "weight_grad"}
    # each bar a little short of its slot, so neighbours of one colour stay apart; the stage on hover
    spans = [Span(r, f"{a.kind}{a.mb} on stage {a.stage}", "compute", t0 / 1e3, (t1 - 0.04 / v) / 1e3,
                  meta={"op": op[a.kind], "label": f"{a.kind}{a.mb}", "stage": a.stage})
             for r, run in enumerate(runs) for a, t0, t1 in run]
    fig = Timeline(spans, len(acts)).figure(title=title + f" (planned: bubble {sc.bubble(runs):.3f})", numbers=False)
    fig.update_xaxes(title="time in units of one forward of one rank's layers (planned, not measured)")
    return fig


def breakdown(timeline) -> dict:
    """The step of a measured run, and per rank the fractions of it spent computing (F, B, W), waiting
    for another stage (in a receive, or before its first and after its last action: the bubble) and on
    the rest (posting messages, Python: overhead)."""
    compute = [s for s in timeline.spans if s.kind == "compute" and s.depth == 0]
    t0 = min(s.start for s in timeline.spans)
    t1 = max(s.end for s in compute)
    out = {"step": t1 - t0, "ranks": []}
    for r in range(timeline.world_size):
        mine = union((s.start, s.end) for s in compute if s.rank == r)
        recv = [(max(s.start, t0), min(s.end, t1)) for s in timeline.spans
                if s.rank == r and s.meta.get("op") == "recv"]
        edges = [(t0, mine[0][0]), (mine[-1][1], t1)] if mine else [(t0, t1)]
        waiting = length(recv + edges) - length(intersect(recv + edges, mine))
        busy = length(mine)
        out["ranks"].append({"busy": busy / (t1 - t0), "bubble": waiting / (t1 - t0),
                             "overhead": 1 - (busy + waiting) / (t1 - t0)})
    for key in ("busy", "bubble", "overhead"):
        out[key] = sum(row[key] for row in out["ranks"]) / len(out["ranks"])
    return out


def measure(cluster, fns: dict, name: str, m: int, v: int = 1, cost: float | None = None,
            repeats: int | None = None) -> dict:
    """Schedule ``name`` (lablib's, or the learner's in ``fns``, from ``yours``) run on ``cluster`` with
    ``fns["execute"]`` on m micro-batches ("naive": the same rows as one batch): the timeline of its last step, the breakdown of that step, the theory's bubble
    and the peak activations a rank held, in bytes and in micro-batches."""
    from ..paths import quick

    repeats = repeats or (1 if quick() else 2)
    naive = name == "naive"  # the same batch, as one micro-batch
    schedule_fn = (lambda p, m, v=1: fns["gpipe"](p, 1)) if naive else fns[name]
    rows = m * (4 if cost else ref.REAL["rows_per_mb"]) if naive else None
    results = cluster.run(ref.step_job, fns["execute"], schedule_fn, 1 if naive else m, v, cost, repeats, rows)
    timeline = cluster.timeline()
    p = cluster.world_size
    return {"name": name, "p": p, "m": 1 if name == "naive" else m, "v": v, "timeline": timeline, "cost": cost,
            **breakdown(timeline), "theory": sc.theory(name, p, m, v),
            "peak": [r["peak"] for r in results], "per_mb": results[0]["per_mb"]}


TITLES = {"naive": "naive (whole batch)", "gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B",
          "zb-h1": "ZB-H1"}


def timelines(runs):
    """The measured runs one above the other on one time axis."""
    return compare(*[r["timeline"] for r in runs], titles=[
        f"{TITLES[r['name']]}, p={r['p']}" + (f", m={r['m']}" if r["name"] != "naive" else "")
        + (f", v={r['v']}" if r["v"] > 1 else "")
        + (" (measured)" if r["cost"] is None else f" (simulated compute, {r['cost'] * 1e3:g} ms a block)") for r in runs])


def table(runs) -> str:
    """One line per run: the step, its busy/bubble/overhead split and the theory's bubble, under a line
    that says what was measured (real compute, or simulated compute with real messages)."""
    costs = {r["cost"] for r in runs}
    how = ("measured on this machine: real compute, real messages" if costs == {None} else
           f"simulated compute ({', '.join(f'{c * 1e3:g} ms' for c in sorted(costs - {None}))} per block, "
           "a full backward twice that), real messages" + (", and runs with real compute" if None in costs else ""))
    how += "; each row: its schedule's last timed step, after a warm-up"
    lines = [how, f"{'schedule':<21}{'p':>3}{'m':>4}{'v':>3}{'step ms':>9}{'busy':>7}{'bubble':>8}{'theory':>8}"
                  f"{'overhead':>10}"]
    for r in runs:
        lines.append(f"{TITLES[r['name']]:<21}{r['p']:>3}{r['m']:>4}{r['v']:>3}{r['step'] * 1e3:>9.1f}{r['busy']:>7.2f}"
                     f"{r['bubble']:>8.3f}{r['theory']:>8.3f}{r['overhead']:>10.3f}")
    return "\n".join(lines)
