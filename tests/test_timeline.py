"""Timelines: spans recorded on real ranks, merged on one clock, drawn and exported."""
import json
import time

import torch
import torch.distributed as dist

import lablib
from lablib.timeline import Span, Timeline


def _staggered():
    # Rank r computes for 30 ms, then everyone meets in a barrier, so on one clock every
    # rank's "after" span must start after every rank's "before" span ended.
    r = dist.get_rank()
    with lablib.span("before", kind="compute", layer=r):
        time.sleep(0.03 * (r + 1))
    lablib.barrier()
    with lablib.span("after"):
        x = torch.ones(1 << 14)
        with lablib.span("inner"):
            x.mul_(2)
    lablib.all_reduce(x, name="sum")
    return r


def test_spans_from_every_rank_on_one_clock(cluster):
    cluster.run(_staggered)
    tl = cluster.timeline()
    n = cluster.world_size
    by = {(s.rank, s.name): s for s in tl.spans}
    assert {r for r, _ in by} == set(range(n))
    for r in range(n):
        assert by[(r, "before")].duration >= 0.03 * (r + 1) - 1e-3  # a busy machine only adds
        assert by[(r, "inner")].depth == 1 and by[(r, "after")].depth == 0
        assert by[(r, "sum")].kind == "comm" and by[(r, "sum")].bytes == (1 << 14) * 4
        assert by[(r, "barrier")].kind == "comm"
    last_before_end = max(by[(r, "before")].end for r in range(n))
    for r in range(n):
        assert by[(r, "after")].start >= last_before_end - tl.clock_error - 1e-4
    # every rank waited in the barrier for the slowest rank
    for r in range(n):
        assert by[(r, "barrier")].end >= last_before_end - tl.clock_error - 1e-4


def _overlap():
    dist.barrier()  # both start together, however late the job reached each rank
    if dist.get_rank() == 0:
        x = torch.ones(4)
        work = lablib.all_reduce(x, async_op=True, name="async sum")
        with lablib.span("compute while waiting"):
            while not work.is_completed():  # however late rank 1 comes, this outlasts the transfer
                time.sleep(0.01)
            time.sleep(0.1)
        work.wait()
    else:
        time.sleep(0.3)
        lablib.all_reduce(torch.ones(4), name="async sum")


def test_async_span_runs_from_issue_to_completion(cluster):
    cluster.run(_overlap)
    tl = cluster.timeline()
    (a,) = [s for s in tl.spans if s.rank == 0 and s.name == "async sum"]
    (c,) = [s for s in tl.spans if s.rank == 0 and s.name == "compute while waiting"]
    assert a.is_async and a.kind == "comm"
    # completes when the last peer joins (after its 300 ms), not when rank 0 calls wait() (>= 100 ms later)
    assert a.duration > 0.2, a.duration
    assert a.start <= c.start + 1e-3
    assert a.end < c.end - 0.05


def test_figure_has_a_row_per_rank_and_hover_details(cluster):
    cluster.run(_staggered)
    fig = cluster.timeline().figure()
    names = {t.name for t in fig.data}
    assert {"compute", "comm"} <= names
    ys = set()
    for t in fig.data:
        ys |= set(t.y)
        assert t.orientation == "h"
    assert ys == set(range(cluster.world_size))
    comm = next(t for t in fig.data if t.name == "comm")
    assert any("65.5 KB" in row for row in map(str, comm.customdata))
    assert list(fig.layout.yaxis.ticktext) == [f"rank {r}" for r in range(cluster.world_size)]
    colors = {t.name: t.marker.color for t in fig.data}
    assert len(set(colors.values())) == len(colors)


def test_idle_gaps_and_summary():
    spans = [Span(0, "a", "compute", 0.0, 1.0), Span(0, "b", "comm", 2.0, 3.0),
             Span(1, "c", "compute", 0.0, 3.0), Span(1, "x", "compute", 0.5, 0.6, depth=1)]
    tl = Timeline(spans, 2)
    gaps = tl.idle()
    assert [(g.rank, g.start, g.end) for g in gaps] == [(0, 1.0, 2.0)]
    s = tl.summary()
    assert s[0] == {"compute": 1.0, "comm": 1.0, "idle": 1.0, "async comm": 0.0}
    assert s[1]["compute"] == 3.0  # the nested span is not counted twice
    assert "rank 0: compute 1000.00 ms, comm 1000.00 ms, idle 1000.00 ms" in repr(tl)


def test_chrome_trace_is_valid_trace_event_json(cluster, tmp_path):
    cluster.run(_overlap)
    path = cluster.timeline().save_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(open(path).read())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(cluster.timeline().spans)
    for e in spans:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))
    thread_names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert thread_names[0] == "rank 0" and thread_names[1000] == "rank 0 async comm"
    assert any(e["tid"] == 1000 and e["name"] == "async sum" for e in spans)


def test_timeline_renders_as_plotly_json():
    tl = Timeline([Span(0, "a", "compute", 0.0, 0.001, bytes=10)], 1)
    bundle = tl._repr_mimebundle_()
    fig = bundle["application/vnd.plotly.v1+json"]
    json.dumps(fig)  # serialisable as is
    assert fig["data"][0]["type"] == "bar" and "text/plain" in bundle


def test_span_outside_a_job_records_nothing_and_rejects_bad_kinds():
    with lablib.span("local"):
        pass
    try:
        lablib.span("x", kind="network")
    except ValueError as e:
        assert "compute" in str(e)
    else:
        raise AssertionError("an unknown kind must be rejected")
