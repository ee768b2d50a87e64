"""Drawing plotly figures in a real Chromium (Playwright), for the browser tests and the timeline benchmark."""
import os
import shutil
from pathlib import Path

import plotly

CHROMIUM = next((p for p in (os.environ.get("LABLIB_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)
# WebGL (the timeline's bars) in software: no GPU is needed or used.
FLAGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--use-angle=swiftshader", "--enable-unsafe-swiftshader"]


def require_chromium():
    """Skip the calling test module when no Chromium is installed, unless LABLIB_REQUIRE_BROWSER=1 (as
    in CI), where a missing browser is a failure."""
    import pytest

    if CHROMIUM is None:
        if os.environ.get("LABLIB_REQUIRE_BROWSER") == "1":
            raise RuntimeError("LABLIB_REQUIRE_BROWSER=1 but no Chromium was found (Debian: apt-get install chromium)")
        pytest.skip("no Chromium found: install it (Debian/Ubuntu: apt-get install chromium) to run the browser tests",
                    allow_module_level=True)
    pytest.importorskip("playwright.sync_api")


PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><script>{js}</script></head>
<body style="margin:0;background:white"><div id="plot" style="width:{width}px"></div><script>
const fig = {fig};
const t0 = performance.now();
Plotly.newPlot("plot", fig.data, fig.layout).then(() => {{
  requestAnimationFrame(() => {{ window.drawMs = performance.now() - t0; window.ready = true; }});
}});
</script></body></html>"""


def write_page(fig, path, width=1100) -> Path:
    path = Path(path)
    path.write_text(_PAGE.format(js=PLOTLY_JS.read_text(), fig=fig.to_json(), width=width))
    return path


class Browser:
    """One headless Chromium; ``open(fig)`` draws a figure and returns the page."""

    def __init__(self, tmp: Path):
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        self._tmp = Path(tmp)

    def open(self, fig, width=1100, name="figure.html"):
        page = self._browser.new_page(viewport={"width": width + 20, "height": int(fig.layout.height or 500) + 40})
        page.goto(write_page(fig, self._tmp / name, width).as_uri())
        page.wait_for_function("window.ready === true", timeout=120_000)
        return page

    def close(self):
        self._browser.close()
        self._pw.stop()


def count_colour(page, hex_colour: str, tolerance: int = 12) -> int:
    """Pixels of the page's screenshot within ``tolerance`` of ``hex_colour`` on every channel."""
    import base64

    shot = base64.b64encode(page.screenshot(full_page=True)).decode()
    rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return page.evaluate("""async ([png, rgb, tol]) => {
        const img = new Image(); img.src = "data:image/png;base64," + png; await img.decode();
        const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
        const g = c.getContext("2d"); g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4)
            if (Math.abs(d[i] - rgb[0]) <= tol && Math.abs(d[i+1] - rgb[1]) <= tol && Math.abs(d[i+2] - rgb[2]) <= tol) n++;
        return n; }""", [shot, rgb, tolerance])
