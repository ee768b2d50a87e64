"""Timelines drawn by a real Chromium: lab 02's ring chart must show its send and recv bars and its
messages (it once drew idle bars over them and looked blank). Skipped without Chromium unless
LABLIB_REQUIRE_BROWSER=1 (as in CI)."""
import pytest
import torch
from render import Browser, count_colour, require_chromium

from lablib.answers.lab02 import ring_all_gather
from lablib.views.timeline import OPS

require_chromium()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("render"))
    yield b
    b.close()


def test_the_ring_chart_shows_every_message(cluster, browser, tmp_path):
    if cluster.world_size != 4:
        pytest.skip("lab 02 draws the ring on 4 ranks")
    cluster.run(ring_all_gather, torch.zeros(4 * 2), torch.ones(2))  # as lab 02 does
    timeline = cluster.timeline()
    fig = timeline.figure(title="ring all-gather on 4 ranks: every message")
    page = browser.open(fig)
    page.screenshot(path=str(tmp_path / "ring.png"), full_page=True)
    send, recv = count_colour(page, OPS["send"][0]), count_colour(page, OPS["recv"][0])
    # 12 sends and 12 recvs, each a 14 px thick bar: hundreds of pixels each, where a chart with the
    # bars hidden (or drawn over) shows none
    assert send > 12 * 50 and recv > 12 * 50, (send, recv)
    fig.data = [t for t in fig.data if t.name != "send"]  # the same chart without its send bars
    assert count_colour(browser.open(fig, name="nosend.html"), OPS["send"][0]) < send / 4
