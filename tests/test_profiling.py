"""PyTorch's own traces in the course's timeline: torch.profiler events become spans on the rank's clock,
comm ops named by the c10d call that issued them (lablib.profiling)."""
import lablib
from lablib.profiling import MARK, spans_from_trace
from lablib.strategies import fsdp


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
