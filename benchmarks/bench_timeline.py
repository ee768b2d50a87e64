"""How fast a long timeline draws and zooms in Chromium: 10,000 spans (a long pipeline run on 4 ranks).

    python benchmarks/bench_timeline.py [--spans 10000] [--rounds 3]

Target: draws in under 2 s and zooms in under 0.5 s. For comparison, the same spans as SVG bars (one
plotly Bar trace per kind, the way the timeline was drawn before it moved to WebGL), in the same run.
Needs Chromium (Debian: apt-get install chromium) and Playwright (installed with the tests).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import plotly.graph_objects as go

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from render import Browser  # noqa: E402

from lablib.timeline import Span, Timeline  # noqa: E402


def pipeline_spans(total: int, ranks: int = 4) -> list[Span]:
    """A 1F1B-like run: each rank computes F/B per micro-batch and passes activations and gradients on."""
    spans, t = [], [0.0] * ranks
    mb = 0
    while len(spans) < total:
        for r in range(ranks):
            f = Span(r, f"F{mb}", "compute", t[r], t[r] + 1e-3)
            spans.append(f)
            t[r] = f.end
            if r + 1 < ranks:
                s = Span(r, f"send act {mb}", "comm", t[r], t[r] + 2e-4, meta={"op": "send", "peer": r + 1})
                rv = Span(r + 1, f"recv act {mb}", "comm", max(t[r + 1], t[r]), t[r] + 2e-4,
                          meta={"op": "recv", "peer": r})
                spans += [s, rv]
                t[r], t[r + 1] = s.end, max(t[r + 1], rv.end)
        for r in reversed(range(ranks)):
            b = Span(r, f"B{mb}", "compute", t[r], t[r] + 2e-3)
            spans.append(b)
            t[r] = b.end
        mb += 1
    return spans[:total]


def svg_bars(timeline) -> go.Figure:
    fig = go.Figure()
    for kind in ("compute", "comm"):
        group = [s for s in timeline.spans if s.kind == kind]
        fig.add_bar(orientation="h", y=[s.rank for s in group], base=[s.start * 1e3 for s in group],
                    x=[s.duration * 1e3 for s in group], text=[s.name for s in group], name=kind)
    fig.update_layout(barmode="overlay", height=400)
    return fig


def measure(browser, fig, name, rounds):
    draws, zooms = [], []
    for i in range(rounds):
        page = browser.open(fig, name=f"{name}{i}.html")
        draws.append(page.evaluate("window.drawMs") / 1e3)
        zooms.append(page.evaluate("""() => { const t = performance.now(); const d = document.getElementById('plot');
            const r = d._fullLayout.xaxis.range; return Plotly.relayout(d, {'xaxis.range': [r[0], r[0] + (r[1] - r[0]) / 10]})
            .then(() => new Promise(ok => requestAnimationFrame(() => ok((performance.now() - t) / 1e3)))); }"""))
        page.close()
    return draws, zooms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    timeline = Timeline(pipeline_spans(args.spans), 4, title="pipeline")
    t = time.perf_counter()
    fig = timeline.figure()
    build = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        browser = Browser(Path(tmp))
        try:
            rows = [("lablib timeline (WebGL lanes, arrows, numbers)", *measure(browser, fig, "gl", args.rounds)),
                    ("SVG bars, the same spans", *measure(browser, svg_bars(timeline), "svg", args.rounds))]
        finally:
            browser.close()
    print(f"{len(timeline.spans)} spans on 4 ranks, {len(timeline.messages())} messages; building the figure in "
          f"Python: {build:.2f} s")
    print(f"{'':48s} {'draw (s), median':>18s} {'min-max':>12s} {'zoom (s), median':>18s} {'min-max':>12s}")
    for name, draws, zooms in rows:
        print(f"{name:48s} {statistics.median(draws):18.2f} {min(draws):5.2f}-{max(draws):<6.2f} "
              f"{statistics.median(zooms):18.2f} {min(zooms):5.2f}-{max(zooms):<6.2f}")
    print("targets: draw < 2 s, zoom < 0.5 s for the lablib timeline")


if __name__ == "__main__":
    main()
