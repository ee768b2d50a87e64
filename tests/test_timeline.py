"""Timelines: spans recorded on real ranks, merged on one clock, drawn and exported."""
import json
import time

import pytest
import torch
import torch.distributed as dist

import lablib
from lablib.timeline import Span, Timeline
from lablib.views.timeline import LEGENDS


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


def test_figure_has_two_lanes_per_rank_ops_in_colour_and_the_numbers_under_it(cluster):
    cluster.run(_staggered)
    tl = cluster.timeline()
    fig = tl.figure()
    bars = {t.name: t for t in fig.data if t.type == "scattergl" and t.mode == "lines"}
    assert {"compute", "all-reduce", "barrier"} <= set(bars)  # by op, not just compute/comm
    assert len({t.line.color for t in bars.values()}) == len(bars)
    n = cluster.world_size
    lanes = {round(y) for t in bars.values() for y in t.y if y is not None}
    assert lanes == {3 * r for r in range(n)} | {3 * r + 1 for r in range(n)}  # compute and comm lanes
    assert {y for y in bars["all-reduce"].y if y is not None} == {3 * r + 1 for r in range(n)}
    assert any("65.5 KB" in (t or "") for t in bars["all-reduce"].text)
    assert "idle" not in " ".join(bars)  # idle is the gaps, never a bar drawn over work
    (table,) = [t for t in fig.data if t.type == "table"]
    assert list(table.cells.values[0]) == [f"rank {r}" for r in range(n)]
    assert list(fig.layout.yaxis.ticktext)[:2] == ["rank 0 compute", "rank 0 comm"]


def _ring_messages():
    from lablib.answers.lab02 import ring_all_gather

    lablib.barrier()
    n = dist.get_world_size()
    ring_all_gather(torch.zeros(2 * n), torch.ones(2))


def test_messages_are_arrows_in_the_chart_and_flows_in_the_trace(cluster, tmp_path):
    cluster.run(_ring_messages)
    tl = cluster.timeline()
    n = cluster.world_size
    pairs = tl.messages()
    assert len(pairs) == n * (n - 1)  # N-1 steps, one message per rank each
    for send, recv in pairs:
        assert (send.meta["peer"], recv.meta["peer"]) == (recv.rank, send.rank)
        assert send.meta["chunk"] == recv.meta["chunk"] and send.meta["step"] == recv.meta["step"]
    (arrows,) = [t for t in tl.figure().data if t.name == "message"]
    assert arrows.marker.symbol == "arrow" and sum(1 for x in arrows.x if x is None) == len(pairs)
    trace = json.loads(open(tl.save_chrome_trace(tmp_path / "ring.json")).read())["traceEvents"]
    starts = [e for e in trace if e["ph"] == "s"]
    ends = {e["id"]: e for e in trace if e["ph"] == "f"}
    assert len(starts) == len(ends) == len(pairs)
    for e in starts:
        assert ends[e["id"]]["pid"] == (e["pid"] + 1) % n  # round the ring


def test_compare_draws_runs_on_one_time_axis_with_their_step_times():
    a = Timeline([Span(0, "F0", "compute", 0.0, 0.010)], 1, title="no prefetch")
    b = Timeline([Span(0, "F0", "compute", 0.0, 0.0075)], 1, title="prefetch")
    fig = lablib.compare(a, b)
    heads = [ann.text for ann in fig.layout.annotations]
    assert heads == ["no prefetch: 10.00 ms", "prefetch: 7.50 ms, -25% vs no prefetch"]
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    fig = lablib.compare(a, b, steps=[0.020, 0.022])  # medians of several steps, of which each drawn is the last
    heads = [ann.text for ann in fig.layout.annotations]
    assert heads == ["no prefetch: median step 20.00 ms (drawn: the last, 10.00 ms)",
                     "prefetch: median step 22.00 ms, +10% vs no prefetch (drawn: the last, 7.50 ms)"]
    with pytest.raises(ValueError, match="2 timelines but 1 step times"):
        lablib.compare(a, b, steps=[0.02])
    fig = lablib.compare(a, b, steps=[0.020, 0.01999])  # within half a percent: no "-0%"
    assert fig.layout.annotations[1].text.startswith("prefetch: median step 19.99 ms, the same as no prefetch")


def test_compare_keeps_queued_time_and_fits_labels_to_the_shared_axis():
    # a collective queued from 1.002 to 1.006 s, running to 1.010 s, in a run that starts at 1.0 s
    queued = Span(0, "RS3", "comm", 1.002, 1.010, runs_from=1.006)
    a = Timeline([Span(0, "F0", "compute", 1.0, 1.0015), queued], 1, title="a")
    b = Timeline([Span(0, "F0", "compute", 0.0, 0.001), Span(0, "B0", "compute", 0.0, 0.100)], 1, title="b")
    fig = lablib.compare(a, b)
    (line,) = [t for t in fig.data if t.name == LEGENDS["queued"]]
    assert [round(x, 6) for x in line.x[:3]] == [2.0, 4.0, 6.0]  # still queued, in ms from the run's start
    labels = [t for t in fig.data if t.name == "labels"]
    # a's "F0" is 15% of its own run but 1.5% of the shared axis (b runs 100 ms): no room for a label
    assert all("F0" not in t.text for t in labels) and any("B0" in t.text for t in labels)


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
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert names[(0, None)] == "rank 0" and names[(0, 0)] == "compute" and names[(0, 1)] == "comm"
    assert any(e["pid"] == 0 and e["tid"] == 1 and e["name"] == "async sum" for e in spans)


def test_timeline_renders_as_plotly_json():
    tl = Timeline([Span(0, "a", "compute", 0.0, 0.001, bytes=10)], 1)
    bundle = tl._repr_mimebundle_()
    fig = bundle["application/vnd.plotly.v1+json"]
    json.dumps(fig)  # serialisable as is
    assert fig["data"][0]["type"] == "scattergl" and "text/plain" in bundle


def test_span_outside_a_job_records_nothing_and_rejects_bad_kinds():
    with lablib.span("local"):
        pass
    try:
        lablib.span("x", kind="network")
    except ValueError as e:
        assert "compute" in str(e)
    else:
        raise AssertionError("an unknown kind must be rejected")


def test_a_chrome_trace_loads_back_into_the_same_timeline(tmp_path):

    spans = [Span(0, "F0", "compute", 0.001, 0.003, meta={"op": "forward", "label": "F0"}),
             Span(0, "inner", "compute", 0.0015, 0.002, depth=1),
             Span(0, "send F0", "comm", 0.003, 0.004, bytes=512, is_async=True, meta={"op": "send", "peer": 1, "tag": 4}),
             Span(1, "recv F0", "comm", 0.0025, 0.0041, bytes=512, is_async=True, meta={"op": "recv", "peer": 0, "tag": 4})]
    before = Timeline(spans, 2, clock_error=1e-4, title="two ranks")
    after = Timeline.load(before.save_chrome_trace(tmp_path / "t.json"))
    assert (after.world_size, after.clock_error, after.title) == (2, 1e-4, "two ranks")
    key = lambda s: (s.rank, s.name, s.kind, round(s.start, 9), round(s.end, 9), s.depth, s.bytes, s.is_async, s.meta)  # noqa: E731
    assert sorted(map(key, after.spans)) == sorted(map(key, before.spans))
    assert len(after.messages()) == 1
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        Timeline.load(tmp_path / "bad.json")


def _late_waits():
    r = dist.get_rank()
    t = torch.ones(1024)  # 4 KB
    if r == 0:
        work = lablib.isend(t, 1, name="early send")
        time.sleep(0.4)   # the peer received it long ago
        work.wait()
    elif r == 1:
        work = lablib.irecv(t, 0, name="early recv")
        time.sleep(0.4)
        work.wait()
    lablib.barrier()


def test_a_message_s_bars_end_when_it_was_delivered_not_when_its_handle_was_waited(cluster):
    cluster.run(_late_waits)
    spans = {s.name: s for s in cluster.timeline().spans}
    send, recv = spans["early send"], spans["early recv"]
    assert send.duration < 0.2 and recv.duration < 0.2  # not the 0.4 s until wait()
    assert send.end <= recv.end + 0.05   # a send is done once its peer has the data


def test_a_plan_has_no_comm_lanes_and_a_rank_s_later_stage_is_outlined_and_named():
    # rank 0 of 2 holds stages 0 and 2 (interleaved): its stage-2 bars are outlined and labelled with the stage
    spans = [Span(0, "F0 on stage 0", "compute", 0.000, 0.010, meta={"op": "forward", "label": "F0", "stage": 0}),
             Span(0, "F0 on stage 2", "compute", 0.010, 0.020, meta={"op": "forward", "label": "F0", "stage": 2}),
             Span(1, "F0 on stage 1", "compute", 0.005, 0.015, meta={"op": "forward", "label": "F0", "stage": 1})]
    fig = Timeline(spans, 2).figure(numbers=False)
    assert list(fig.layout.yaxis.ticktext) == ["rank 0", "rank 1"]
    outline = [t for t in fig.data if t.name == "outlined: a rank's later stage"]
    assert len(outline) == 1 and [x for x in outline[0].x if x is not None] == [10.0, 15.0, 20.0]
    (labels,) = [t for t in fig.data if t.name == "labels"]
    assert sorted(labels.text) == ["F0", "F0·s0", "F0·s2"]  # rank 1 holds one stage: no stage in its label
