"""PyTorch's own traces in the course's timeline: torch.profiler events become spans on the rank's clock,
comm ops named by the c10d call that issued them (lablib.profiling)."""
import pytest

import lablib
from lablib.profiling import MARK, STEPS, spans_from_trace, window
from lablib.strategies import fsdp
from lablib.timeline import Timeline


def X(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def test_trace_events_become_spans_on_the_rank_clock():
    events = [X(MARK, 1000.0, 0.5), X("FSDP::pre_forward (0)", 1005.0, 20.0),
              X("_c10d_functional::wait_tensor", 1012.0, 3.0), X("aten::mm", 1013.0, 1.0),
              X("c10d::_reduce_scatter_base_", 1010.0, 0.2), X("gloo:all_reduce", 1011.0, 5.0, tid=2),
              X("aten::add", 1030.0, 2.0), {"ph": "M", "name": "thread_name", "tid": 2, "pid": 1}]
    spans = spans_from_trace(events, mark_ns=5_000_000)  # the marker was at 5 ms on the rank's clock
    comm = [s for s in spans if s.kind == "comm"]
    assert [(s.name, s.meta["op"], s.t0, s.t1, s.is_async) for s in comm] == \
        [("gloo:all_reduce", "reduce_scatter", 5_011_000, 5_016_000, True)]  # Gloo's name, c10d's op
    compute = [(s.name, s.t0, s.t1) for s in spans if s.kind == "compute"]
    # top-level only, with the wait on the collective cut out; the marker and the c10d call are not compute
    assert compute == [("FSDP::pre_forward (0)", 5_005_000, 5_012_000), ("FSDP::pre_forward (0)", 5_015_000, 5_025_000),
                       ("aten::add", 5_030_000, 5_032_000)]


def test_fsdp2_under_the_profiler_draws_as_a_timeline(cluster):
    n = cluster.world_size
    results = cluster.run(lablib.profiled, fsdp.fsdp2_train, "mlp", 1)
    assert all(set(r) == {"params", "memory"} for r in results)  # the function's own result comes back
    tl = cluster.timeline()
    comm = [s for s in tl.spans if s.kind == "comm"]
    assert {s.meta["op"] for s in comm} == {"all_gather", "reduce_scatter"}
    # FSDP2's reduce-scatter runs as gloo:all_reduce on Gloo: the op comes from the c10d call
    assert any(s.name == "gloo:all_reduce" and s.meta["op"] == "reduce_scatter" for s in comm)
    assert {s.rank for s in tl.spans} == set(range(n))
    assert all(s.meta.get("source") == "torch.profiler" for s in tl.spans)
    assert tl.figure() is not None


def _three_all_reduces():
    import torch
    import torch.distributed as dist

    from lablib.profiling import steps_begin, steps_end

    dist.all_reduce(torch.ones(8))   # set-up: left out
    steps_begin()
    dist.all_reduce(torch.ones(8))   # the part worth drawing
    steps_end()
    dist.all_reduce(torch.ones(8))   # results: left out


def test_a_profiled_job_draws_only_between_steps_begin_and_steps_end(cluster):
    cluster.run(lablib.profiled, _three_all_reduces)
    comm = [s for s in cluster.timeline().spans if s.kind == "comm" and s.rank == 0]
    assert len(comm) == 1 and comm[0].meta.get("op") == "all_reduce"


def test_the_part_worth_drawing_is_cut_where_its_markers_are_on_the_profilers_clock():
    """steps_begin and steps_end leave markers in the profile, read on the clock the spans are read on, so a shift
    of the marker that ties the clocks shifts both alike; the markers are no spans themselves."""
    events = [X(MARK, 1000.0, 0.5), X("lablib.warm-up", 999.0, 0.2), X("aten::add", 1001.0, 1.0),
              X(STEPS[0], 1003.0, 0.0), X("aten::mul", 1004.0, 1.0), X(STEPS[1], 1010.0, 0.0),
              X("aten::sub", 1011.0, 1.0)]
    for mark_ns in (5_000_000, 5_004_000):  # the marker 4 ms off: the window moves with the spans
        begin, end = window(events, mark_ns)
        assert (begin, end) == (mark_ns + 3_000, mark_ns + 10_000)
        spans = spans_from_trace(events, mark_ns)
        assert [s.name for s in spans] == ["aten::add", "aten::mul", "aten::sub"]
        assert [s.name for s in spans if begin <= s.t0 < end] == ["aten::mul"]
    assert window([X(MARK, 1000.0, 0.5)], 5_000_000) == (float("-inf"), float("inf"))  # no markers: all of it


def test_a_collective_learns_when_the_backend_ran_it_from_the_profiler():
    from lablib.profiling import backend_runs, mark_runs
    from lablib.timeline import RawSpan

    worker = 2  # the main thread is tid 1 (X's default)
    events = [X(MARK, 1000.0, 0.5), X("c10d::barrier", 1001.0, 0.1),   # an untraced call: no span of its own
              X("c10d::allreduce_", 1010.0, 0.2), X("c10d::_allgather_base_", 1011.0, 0.2),
              X("c10d::send", 1015.0, 0.2), X("gloo:send", 1015.1, 9.0),  # point to point: on the main thread
              X("gloo:barrier", 1001.05, 0.5, tid=worker), X("gloo:all_reduce", 1010.1, 8.0, tid=worker),
              X("gloo:all_gather", 1018.2, 2.0, tid=worker)]          # queued until the all-reduce was done
    runs = backend_runs(events, mark_ns=5_000_000)
    assert [(r[0], r[1], r[3]) for r in runs] == [(5_001_000, 5_001_050, "barrier"), (5_010_000, 5_010_100, "all_reduce"),
                                                  (5_011_000, 5_018_200, "all_gather")]
    # lablib's async reduce-scatter on Gloo is an all-reduce; each span opens just before its call
    spans = [RawSpan("rs", "comm", 5_009_990, 5_018_100, 0, 8, True, {"op": "reduce_scatter"}),
             RawSpan("ag", "comm", 5_010_990, 5_020_200, 0, 8, True, {"op": "all_gather"}),
             RawSpan("s", "comm", 5_014_990, 5_024_000, 0, 8, True, {"op": "send", "peer": 1}),
             RawSpan("F0", "compute", 5_011_500, 5_016_000, 0, None, False, {})]
    marked = mark_runs(spans, runs)
    assert [s.meta.get("ran_ns") for s in marked] == [5_010_100, 5_018_200, None, None]
    tl = Timeline.from_raw({0: marked}, {0: 0}, 5_000_000, 1)
    ag = next(s for s in tl.spans if s.name == "ag")
    assert ag.running == pytest.approx(18.2e-6) and ag.start == pytest.approx(10.99e-6)  # s since the origin


def _queued():
    import torch

    big = [torch.ones(4_000_000) for _ in range(4)]  # 16 MB each: Gloo's two threads take a while for each
    works = [lablib.all_reduce(t, async_op=True, name=f"ar{k}") for k, t in enumerate(big)]
    for w in works:
        w.wait()


def test_timed_jobs_show_collectives_queued_behind_gloo_s_two_threads(cluster):
    cluster.run(lablib.timed, _queued)
    tl = cluster.timeline()
    spans = {s.name: s for s in tl.spans if s.rank == 0}
    assert all(s.runs_from is not None for s in spans.values())
    # two run at once; the third waits until one of them is done, the fourth after the third began
    assert spans["ar2"].running > spans["ar2"].start
    assert spans["ar2"].running >= min(spans["ar0"].end, spans["ar1"].end) - 0.002
    assert spans["ar3"].running >= spans["ar2"].running
    row = tl.summary()[0]
    assert row["comm"] < sum(s.duration for s in spans.values())  # queued time is not communication
    fig = tl.figure()
    assert any(t.name == "queued (behind earlier collectives)" for t in fig.data)
