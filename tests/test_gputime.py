"""Spans placed where the GPU ran them (``lablib.gputime``), checked on the CPU against traces in
torch.profiler's format: ``tests/fixtures/gpu/handwritten-step.json``, written by hand with what each span
must become, and any trace ``tests/gpu.sh`` captured on a GPU (copied there, or named by LABLIB_GPU_TRACES)."""
import json
import os
from pathlib import Path

import pytest

from lablib import gputime
from lablib.timeline import RawSpan, Timeline

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
CAPTURED = sorted(Path(os.environ.get("LABLIB_GPU_TRACES") or FIXTURES).glob("*.json"))
US = 1_999_000_000  # the hand-written trace's ts 0 on the rank's clock, ns


def _load(path):
    trace = json.loads(Path(path).read_text())
    return trace, [RawSpan(*s) for s in trace["spans"]]


def _placed(path):
    trace, spans = _load(path)
    records = gputime.device_records(trace["traceEvents"], trace["mark_ns"], trace.get("pauses", []))
    return spans, gputime.on_device(spans, records)


def test_each_span_runs_where_its_own_kernels_ran():
    trace, _ = _load(FIXTURES / "handwritten-step.json")
    _, placed = _placed(FIXTURES / "handwritten-step.json")
    got = {s.name: [(s.t0 - US) / 1000, (s.t1 - US) / 1000, s.meta.get("clock")] for s in placed}
    assert got == trace["expect"]


def test_the_timeline_of_a_gpu_step_hides_what_ran_under_compute():
    _, placed = _placed(FIXTURES / "handwritten-step.json")
    gather = [s for s in placed if s.name in ("fwd L0", "all_gather L1", "fwd L1")]
    row = Timeline.from_raw({0: gather}, {0: 0}, US, 1).summary()[0]
    # the gather's kernel ran 1180-1300 us, the forward's kernels 1150-1260 and 1300-1400: 80 of 120 us hidden
    assert row["comm"] == pytest.approx(120e-6) and row["hidden"] == pytest.approx(80e-6)


def test_work_launched_nowhere_or_outside_every_span_is_left_out():
    trace, spans = _load(FIXTURES / "handwritten-step.json")
    records = gputime.device_records(trace["traceEvents"], trace["mark_ns"])
    assert 99 not in {r.launched for r in records} and len(records) == 7  # the kernel with no launch record
    nccl = [r.name.split("(")[0] for r in records if r.nccl]
    assert nccl == ["ncclDevKernel_AllGather_RING_LL", "ncclDevKernel_SendRecv"]
    assert gputime.on_device(spans, []) == [s._replace(meta={**s.meta, "clock": "host"}) if s.kind != "idle" else s
                                            for s in spans]


def test_records_land_on_the_span_clock_which_a_simulated_link_pauses():
    trace, _ = _load(FIXTURES / "handwritten-step.json")
    plain = gputime.device_records(trace["traceEvents"], trace["mark_ns"])
    # from ts 1290 us on (2000290000 ns on perf_counter_ns), the span clock ran 30 us behind
    paused = gputime.device_records(trace["traceEvents"], trace["mark_ns"], [(0, 0), (2000290000, 30000)])
    shift = lambda t: t - 30000 if t >= 2000290000 else t  # noqa: E731
    assert [(p.launched, p.start, p.end) for p in paused] == [(shift(p.launched), shift(p.start), shift(p.end))
                                                              for p in plain]


def test_a_trace_without_the_marker_cannot_be_placed():
    trace, _ = _load(FIXTURES / "handwritten-step.json")
    events = [e for e in trace["traceEvents"] if e.get("name") != "lablib.clock"]
    with pytest.raises(ValueError, match="marker"):
        gputime.device_records(events, trace["mark_ns"])


@pytest.mark.parametrize("path", CAPTURED, ids=[p.name for p in CAPTURED])
def test_a_captured_trace_places_every_span_after_its_launch(path):
    """What holds for any trace: every span kept, in order; one with GPU work starts no earlier than the host
    opened it (less the profiler's clock slack) and ends after it starts; one without keeps its times."""
    spans, placed = _placed(path)
    assert [(s.name, s.kind) for s in placed] == [(s.name, s.kind) for s in spans]
    for before, after in zip(spans, placed):
        clock = after.meta.get("clock")
        assert clock in ((None,) if before.kind == "idle" else (gputime.GPU, gputime.HOST, gputime.BOTH)), after
        if clock == gputime.HOST or clock is None:
            assert (after.t0, after.t1) == (before.t0, before.t1)
        else:
            assert after.t0 >= before.t0 - 500_000 and after.t1 >= after.t0, (before, after)


def test_each_lane_says_the_clock_its_bars_were_placed_by():
    _, placed = _placed(FIXTURES / "handwritten-step.json")
    timeline = Timeline.from_raw({0: placed}, {0: 0}, US, 1)
    ticks = list(timeline.figure().layout.yaxis.ticktext)
    assert [t.split("<br>")[0] for t in ticks] == ["rank 0 compute", "rank 0 comm"]
    assert "GPU kernels + host" in ticks[0] and "GPU kernels + host" in ticks[1]  # "loss" ran on the host
    gpu_only = Timeline.from_raw({0: [s for s in placed if s.name != "loss"]}, {0: 0}, US, 1)
    assert gpu_only.figure().layout.yaxis.ticktext[0].endswith(">GPU kernels</span>")
    _, host = _load(FIXTURES / "handwritten-step.json")  # a run on the CPU records no clock: plain lanes
    assert list(Timeline.from_raw({0: host}, {0: 0}, US, 1).figure().layout.yaxis.ticktext) == ["rank 0 compute",
                                                                                                "rank 0 comm"]



def test_the_profilers_one_cycle_warning_is_not_shown_to_learners():
    """torch 2.11 warns at every start of a profile without a schedule that it "clears events at the end of each
    cycle" (2.13 does not): every rank of every job on a GPU would print it, and a one-off profile has one cycle."""
    import warnings

    class Profile211:
        def start(self):
            warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events from the current "
                          "cycle will be reported.To keep events across cycles, set acc_events=True.", UserWarning)
            warnings.warn("another warning", UserWarning)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gputime.start(Profile211())
    assert [str(w.message) for w in seen] == ["another warning"]
