"""The overlap numbers on hand-made span sets whose answers are known (lablib.overlap)."""
import pytest

from lablib.overlap import breakdown, intersect, length, messages, op_of, phases, union
from lablib.timeline import Span, Timeline


def S(rank, name, kind, start, end, **meta):
    return Span(rank, name, kind, start, end, meta=meta)


def test_intervals():
    assert union([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert length([(0, 2), (1, 3), (5, 6)]) == 4
    assert intersect([(0, 4), (6, 8)], [(3, 7)]) == [(3, 4), (6, 7)]


def test_comm_under_compute_is_hidden_the_rest_exposed():
    spans = [S(0, "F0", "compute", 0, 10), Span(0, "ag", "comm", 5, 15, is_async=True, meta={"op": "all_gather"})]
    row = breakdown(spans, 1)[0]
    assert row == pytest.approx({"compute": 10, "comm": 10, "hidden": 5, "exposed": 5, "waiting": 0, "idle": 0,
                                 "overlap": 0.5})


def test_a_recv_posted_before_its_send_waits_and_that_is_idle_not_comm():
    # rank 1 posts its recv at 0; rank 0 only sends at 4 (a pipeline bubble)
    spans = [S(0, "F0", "compute", 0, 4), S(0, "send", "comm", 4, 5, op="send", peer=1),
             S(1, "recv", "comm", 0, 5, op="recv", peer=0), S(1, "F0", "compute", 5, 9)]
    rows = breakdown(spans, 2)
    assert rows[0] == pytest.approx({"compute": 4, "comm": 1, "hidden": 0, "exposed": 1, "waiting": 0, "idle": 4,
                                     "overlap": 0})
    assert rows[1] == pytest.approx({"compute": 4, "comm": 1, "hidden": 0, "exposed": 1, "waiting": 4, "idle": 4,
                                     "overlap": 0})


def test_a_collective_waits_for_its_last_rank():
    spans = [S(0, "F0", "compute", 0, 2), S(0, "ag", "comm", 2, 6, op="all_gather"),
             S(1, "F0", "compute", 0, 5), S(1, "ag", "comm", 5, 6, op="all_gather")]
    rows = breakdown(spans, 2)
    assert (rows[0]["comm"], rows[0]["waiting"], rows[0]["idle"]) == pytest.approx((1, 3, 3))
    assert (rows[1]["comm"], rows[1]["waiting"], rows[1]["idle"]) == pytest.approx((1, 0, 0))


def test_collectives_called_unevenly_are_not_matched():
    spans = [S(0, "ag", "comm", 0, 4, op="all_gather"), S(1, "F0", "compute", 0, 4)]
    assert breakdown(spans, 2)[0]["comm"] == 4  # rank 1 never called it: no partner to wait for


def test_messages_match_in_order_per_pair():
    spans = [S(0, "s0", "comm", 0, 1, op="send", peer=1), S(0, "s1", "comm", 2, 3, op="send", peer=1),
             S(1, "r1", "comm", 2, 3, op="recv", peer=0), S(1, "r0", "comm", 0, 1, op="recv", peer=0),
             S(1, "s", "comm", 4, 5, op="send", peer=0)]
    assert [(a.name, b.name) for a, b in messages(spans)] == [("s0", "r0"), ("s1", "r1")]


def test_ops_come_from_the_traced_call_or_the_span_name():
    assert [op_of(S(0, n, "compute", 0, 1)) for n in ("fwd L0", "F3", "bwd unit 1", "B2", "W1", "loss")] == \
        ["forward", "forward", "backward", "backward", "weight_grad", "compute"]
    assert op_of(S(0, "all_gather params", "comm", 0, 1, op="all_gather")) == "all_gather"


def test_summary_and_repr_use_the_same_numbers():
    tl = Timeline([S(0, "F0", "compute", 0, 0.002), S(0, "ar", "comm", 0.002, 0.003, op="all_reduce")], 1)
    assert tl.summary()[0]["exposed"] == pytest.approx(0.001)
    assert "exposed 1.00" in repr(tl) and "overlap (hidden / comm) 0%" in repr(tl)


def test_a_collective_queued_behind_others_is_neither_communication_nor_hidden():
    # rank 0 issued the all-reduce at 0 under compute, but Gloo began it only at 6 (queued behind others);
    # rank 1 began it at 7: data moved from 7 to 10
    spans = [S(0, "B1", "compute", 0, 8), Span(0, "ar", "comm", 0, 10, is_async=True, meta={"op": "all_reduce"},
                                               runs_from=6),
             Span(1, "ar", "comm", 2, 10, is_async=True, meta={"op": "all_reduce"}, runs_from=7)]
    rows = breakdown(spans, 2)
    assert rows[0]["comm"] == pytest.approx(3) and rows[0]["hidden"] == pytest.approx(1)
    assert rows[1]["comm"] == pytest.approx(3) and rows[1]["waiting"] == pytest.approx(5)
    assert phases(spans, 2)[id(spans[1])] == pytest.approx((6, 7))  # queued until 6, waiting for rank 1 until 7
