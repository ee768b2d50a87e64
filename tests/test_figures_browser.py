"""lablib's figures drawn by a real Chromium: plotly's toolbar (top right, shown on hover) never covers a title,
a title never covers the subplot titles or the plots under it, also where a figure set a small top margin of its
own, and log axes read as plain numbers (1,000,000, not 1e+06 or 1M). The layout they share is
lablib.views.layout.tidy. Skipped without Chromium unless LABLIB_REQUIRE_BROWSER=1 (as in CI)."""
import pytest
from render import Browser, require_chromium

from lablib.strategies.flat import FlatLayout
from lablib.timeline import Span, Timeline
from lablib.views import collectives, flat, memory, prefetch, tensor_parallel
from lablib.views.layout import log_ticks, tidy
from lablib.views.timeline import compare_figure

require_chromium()

LONG = ("a title as long as the labs' longest (lab 08's planner), which runs on across the figure to its right edge, "
        "where plotly's toolbar is")
_BOXES = """() => { const r = s => [...document.querySelectorAll(s)].map(e => { const b = e.getBoundingClientRect();
  return {left: b.left, top: b.top, right: b.right, bottom: b.bottom}; });
  return {modebar: r('.modebar'), title: r('.gtitle'), notes: r('.annotation-text-g'), plots: r('.nsewdrag'),
          ticks: [...document.querySelectorAll('.xtick text, .ytick text')].map(e => e.textContent)}; }"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("figures"))
    yield b
    b.close()


def _timeline(title=""):
    spans = [Span(r, name, kind, t0, t1, bytes=1 << 20, meta={"op": op} if op else {})
             for r in range(4) for name, kind, op, t0, t1 in (
                 ("F1", "compute", "forward", 0.001 * r, 0.004 + 0.001 * r),
                 ("all_gather", "comm", "all_gather", 0.005, 0.009), ("B1", "compute", "backward", 0.009, 0.015),
                 ("reduce_scatter", "comm", "reduce_scatter", 0.015, 0.02))]
    return Timeline(spans, 4, title=title)


def _sweep():
    return [{"impl": impl, "op": op, "n": n, "bytes": b, "busbw": b / 1e8 * n, "seconds": b / 1e9, "whose": ""}
            for impl in ("ring", "torch") for op in ("all_gather", "reduce_scatter", "all_reduce", "memcpy")
            for n in (2, 4) for b in (1e3, 1e5, 1e7)]


FIGURES = {
    "timeline": lambda: _timeline(LONG).figure(),
    "timeline without a title": lambda: _timeline().figure(title=""),
    "two timelines": lambda: compare_figure([_timeline(), _timeline()], titles=["contiguous", "zig-zag"], title=LONG),
    "flat buffer (its own margin, 70 px)": lambda: flat.layout_figure(FlatLayout(((3, 4), (5,)), 4), title=LONG),
    "bandwidth sweep (subplot titles, log axes)": lambda: collectives.sweep_figure(_sweep()),
    "α-β model (log axes)": lambda: collectives.model_figure(_sweep(), 50e-6, 1e9),
    "memory (its own margin, 50 px)": lambda: memory.memory_figure(
        [{"group": "ZeRO-1", "label": "N=2", "params": 4e3, "grads": 4e3, "optimizer": 4e3, "formula": 12e3}], title=LONG),
    "prefetch depth": lambda: prefetch.depth_figure([{"depth": d, "peak": 1e6 * d, "step": 0.1, "hidden": 0.5}
                                                     for d in (1, 2)]),
    "four-line title": lambda: tensor_parallel.cost_figure(),
}


def _overlap(a, b, slack=1.0) -> bool:
    return (a["left"] < b["right"] - slack and b["left"] < a["right"] - slack
            and a["top"] < b["bottom"] - slack and b["top"] < a["bottom"] - slack)


@pytest.mark.parametrize("name", list(FIGURES))
def test_the_toolbar_title_subplot_titles_and_plots_do_not_overlap(browser, name):
    page = browser.open(FIGURES[name](), name="figure.html")
    page.mouse.move(400, 200)  # the toolbar shows on hover
    boxes = page.evaluate(_BOXES)
    (bar,) = boxes["modebar"]
    titles = boxes["title"]
    above = [n for n in boxes["notes"] if any(n["bottom"] <= p["top"] + 2 for p in boxes["plots"])]  # subplot titles
    for box in titles + above:
        assert not _overlap(box, bar), (name, box, bar)
    for title in titles:
        for other in above + boxes["plots"]:
            assert not _overlap(title, other), (name, title, other)


def test_log_axes_read_as_plain_numbers(browser):
    page = browser.open(FIGURES["α-β model (log axes)"](), name="log.html")
    ticks = page.evaluate(_BOXES)["ticks"]
    assert "10,000,000" in ticks and not any("e+" in t or t.endswith(("k", "M", "G", "B")) for t in ticks), ticks


def test_tidy_keeps_a_larger_margin_and_is_idempotent():
    fig = tensor_parallel.cost_figure()
    assert fig.layout.margin.t == 150  # the figure's own, larger than the title needs
    assert tidy(tidy(fig)).to_dict() == fig.to_dict()


def test_log_ticks_are_plain_numbers_one_three_ten():
    assert log_ticks([0.4, 2500]) == {"tickvals": [0.3, 1, 3, 10, 30, 100, 300, 1000, 3000],
                                      "ticktext": ["0.3", "1", "3", "10", "30", "100", "300", "1,000", "3,000"]}
