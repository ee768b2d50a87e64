"""Lab 02 (collectives): the ring against torch.distributed on real Gloo ranks, the recorded messages,
the sweep's bandwidth arithmetic and the alpha-beta model; Tasks 2.1-2.4's checks."""
import pytest
import torch
import torch.distributed as dist
from procs import HUNG

import lablib
from lablib import bandwidth as B
from lablib.checks import CheckFailed
from lablib.checks.lab02 import (check_ring_all_gather, check_ring_blocking, check_ring_reduce_scatter)
from lablib.comm import all_gather_single, reduce_scatter_single
from lablib.answers import lab02 as ring
from lablib.strategies.ring import transfers
from lablib.views import collectives as views


def _compare(dtype, chunk):
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(chunk * n, generator=g) * 10).to(dtype)
    rs, rs_ref = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
    ring.ring_reduce_scatter(rs, x)
    reduce_scatter_single(rs_ref, x.clone())
    ag, ag_ref = torch.empty(chunk * n, dtype=dtype), torch.empty(chunk * n, dtype=dtype)
    ring.ring_all_gather(ag, x[:chunk])
    all_gather_single(ag_ref, x[:chunk].clone())
    ar, ar_ref = x[:-1].clone(), x[:-1].clone()  # a size n does not divide
    ring.ring_all_reduce(ar)
    dist.all_reduce(ar_ref)
    return [(a.double() - b.double()).abs().max().item() for a, b in ((rs, rs_ref), (ag, ag_ref), (ar, ar_ref))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_ring_matches_torch_distributed(cluster, dtype):
    for chunk in (1, 7, 4096):
        for diffs in cluster.run(_compare, dtype, chunk):
            assert max(diffs) <= (0 if dtype == torch.int64 else 1e-4), diffs


def test_recorded_messages_follow_the_ring(cluster):
    n = cluster.world_size
    cluster.run(ring.ring_all_gather, torch.zeros(3 * n), torch.ones(3))
    steps = transfers(cluster.timeline())
    assert len(steps) == n - 1
    for s, moves in enumerate(steps):
        assert moves == [(r, (r + 1) % n, (r - s) % n) for r in range(n)]
    cluster.run(ring.ring_reduce_scatter, torch.zeros(3), torch.ones(3 * n))
    for s, moves in enumerate(transfers(cluster.timeline())):
        assert moves == [(r, (r + 1) % n, (r - s - 1) % n) for r in range(n)]


def test_explorer_replays_a_run_to_the_right_end_state(cluster):
    n = cluster.world_size
    cluster.run(ring.ring_all_gather, torch.zeros(2 * n), torch.ones(2))
    widget = views.ring_explorer(cluster.timeline(), "all_gather")
    slider = widget.children[0]
    assert slider.max == n - 1
    slider.value = n - 1  # redraws without error at the last step


def test_sweep_rows_and_bandwidth_arithmetic(cluster):
    n = cluster.world_size
    rows = B.sweep(cluster, [1 << 12, 1 << 16], iters=2)
    assert {(r["op"], r["impl"]) for r in rows} == {(op, impl) for op in B.OPS for impl in ("ring", "torch")} | {
        ("memcpy", "torch")}
    for r in rows:
        assert r["seconds"] > 0 and r["algbw"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * B.BUS_FACTOR[r["op"]](n))
        assert r["bytes"] % n == 0


def test_the_sweep_times_the_learners_ring_once_its_check_passed(cluster):
    from lablib.checks import PASSED

    def mine(output, input):  # right, and the learner's: only used once Task 2.2's check has passed
        ring.ring_all_gather(output, input)

    saved = set(PASSED)  # what earlier tests in this process passed (another Task 2.x among them) left out
    PASSED.clear()
    try:
        assert B.learner_rings(all_gather=mine)[1]["all_gather"] == "lablib's"
        PASSED.add("Task 2.2")
        chosen, whose = B.learner_rings(all_gather=mine, reduce_scatter=mine)
    finally:
        PASSED.clear()
        PASSED.update(saved)
    assert chosen["all_gather"] is mine and whose == {"all_gather": "yours", "reduce_scatter": "lablib's",
                                                      "all_reduce": "lablib's"}
    rows = B.sweep(cluster, [1 << 12], iters=1, ring=chosen, whose=whose)
    assert {(r["op"], r["whose"]) for r in rows if r["impl"] == "ring"} == set(whose.items())


def test_alpha_beta_fit_recovers_a_known_machine():
    alpha, beta = 50e-6, 2e9
    rows = [dict(n=n, bytes=s, op="all_gather", impl="ring", seconds=B.predict("all_gather", s, n, alpha, beta))
            for n in (2, 4) for s in (1e3, 1e5, 1e7)]
    a, b = B.fit_alpha_beta(rows)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    assert B.predict("all_reduce", 1e9, 8, 0, 1e9) == pytest.approx(2 * 7 / 8)


def test_quick_sweep_stops_at_4_mb(monkeypatch):
    monkeypatch.setenv("LABLIB_QUICK", "1")
    assert B.sweep_sizes()[-1] == 4 << 20
    monkeypatch.setenv("LABLIB_QUICK", "0")
    assert B.sweep_sizes() == [1 << k for k in range(10, 27, 2)]


def test_ring_checks_teach(fragile):
    import time

    def everyone_sends_first(output, input):
        rank, n = dist.get_rank(), dist.get_world_size()
        chunks = output.view(n, -1)
        chunks[rank].copy_(input)
        for step in range(n - 1):
            lablib.send(chunks[(rank - step) % n], (rank + 1) % n)
            lablib.recv(chunks[(rank - step - 1) % n], (rank - 1) % n)

    def forgets_own_chunk(output, input):
        rank, n = dist.get_rank(), dist.get_world_size()
        chunks = output.view(n, -1)
        for step in range(n - 1):
            lablib.exchange(sends=[(chunks[(rank - step) % n], (rank + 1) % n)],
                            recvs=[(chunks[(rank - step - 1) % n], (rank - 1) % n)]).wait()

    def library_call(output, input):
        lablib.all_gather(output, input)

    def untraced_library_call(output, input):  # torch's collective, plus dummy messages to match the count
        dist.all_gather_into_tensor(output, input)
        for _ in range(dist.get_world_size() - 1):
            lablib.isend(torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size()).wait()

    def ring_reduce_scatter(output, input):
        rank, n = dist.get_rank(), dist.get_world_size()
        partial = input.reshape(n, -1).clone()
        incoming = torch.empty_like(partial[0])
        for step in range(n - 1):
            lablib.exchange(sends=[(partial[(rank - step - 1) % n], (rank + 1) % n)],
                            recvs=[(incoming, (rank - 1) % n)]).wait()
            partial[(rank - step - 2) % n] += incoming
        output.view(-1).copy_(partial[rank])

    t = time.perf_counter()
    with pytest.raises(CheckFailed, match="(?s)deadlock under NCCL's rules.*if every rank sends first, nobody receives. "
                                          "Alternate the order.*rank \\d in send"):
        check_ring_blocking(everyone_sends_first, fragile)
    assert time.perf_counter() - t < fragile.timeout + HUNG
    with pytest.raises(CheckFailed, match="differs from what dist.all_gather_into_tensor gives.*copy your own input"):
        check_ring_all_gather(forgets_own_chunk, fragile)
    with pytest.raises(CheckFailed, match="uses lablib.all_gather: build it from point-to-point messages"):
        check_ring_all_gather(library_call, fragile)
    with pytest.raises(CheckFailed, match="uses dist.all_gather_into_tensor: build it from point-to-point"):
        check_ring_all_gather(untraced_library_call, fragile)
    with pytest.raises(CheckFailed, match="Task 2.1 asks for blocking lablib.send"):
        check_ring_blocking(ring_reduce_scatter, fragile)
    with pytest.raises(CheckFailed, match="ring_reduce_scatter is lablib's own"):
        check_ring_reduce_scatter(ring.ring_reduce_scatter, fragile)
    check_ring_reduce_scatter(ring_reduce_scatter, fragile)


def _ungrouped_reduce_scatter(output, input):  # the send and the receive of a step posted apart
    rank, n = dist.get_rank(), dist.get_world_size()
    partial = input.reshape(n, -1).clone()
    incoming = torch.empty_like(partial[0])
    for step in range(n - 1):
        handles = [lablib.isend(partial[(rank - step - 1) % n], (rank + 1) % n), lablib.irecv(incoming, (rank - 1) % n)]
        for h in handles:
            h.wait()
        partial[(rank - step - 2) % n] += incoming
    output.view(-1).copy_(partial[rank])


def test_a_ring_posted_ungrouped_deadlocks_under_nccls_rules_and_passes_on_gloo_alone(fragile, monkeypatch):
    """NCCL runs a rank's sends and receives in the order posted and a send waits for its receive: every rank's
    send first is a deadlock there at every P. The check holds Gloo to that and names the fix; Gloo alone lets
    the same code through."""
    from lablib import p2p

    with pytest.raises(CheckFailed, match=r"(?s)NCCL's rules.*lablib.exchange\(sends=.*rank \d waits to send to rank \d"):
        check_ring_reduce_scatter(_ungrouped_reduce_scatter, fragile)
    monkeypatch.setattr(p2p, "CHECKS", False)
    check_ring_reduce_scatter(_ungrouped_reduce_scatter, fragile)


def _three_collectives():
    x, out = torch.ones(1 << 18), torch.empty((1 << 18) // dist.get_world_size())
    lablib.reduce_scatter(out, x)
    lablib.all_gather(x, out)
    lablib.all_reduce(x)


def test_bytes_on_the_wire_are_measured_beside_the_ring_model(cluster):
    """The kernel's count of what each rank sent: the ring's volume for all-gather and all-reduce (plus
    headers), twice it for Gloo's reduce-scatter, which is an all-reduce underneath."""
    from lablib.comm import BUS_FACTOR, bytes_on_wire

    cluster.run(_three_collectives)
    n, size = cluster.world_size, (1 << 18) * 4
    for op, factor in (("all_gather", 1), ("all_reduce", 1), ("reduce_scatter", 2)):
        spans = [s for s in cluster.timeline().spans if s.meta.get("op") == op]
        wire = sum(s.meta["wire"] for s in spans) / n
        assert factor * BUS_FACTOR[op](n) * size <= wire <= factor * BUS_FACTOR[op](n) * size * 1.02 + 4096, (op, wire)
    assert bytes_on_wire(cluster.timeline()) == sum(s.meta["wire"] for s in cluster.timeline().spans) / n


def _ring_with_a_made_up_span(output, input):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank].copy_(input)
    for step in range(n - 1):
        send = lablib.isend(chunks[(rank - step) % n], (rank + 1) % n)
        lablib.recv(chunks[(rank - step - 1) % n], (rank - 1) % n)
        send.wait()
    with lablib.span("send to nobody", "comm", bytes=12345, op="send"):  # a bar on the timeline, not a message
        pass


def test_messages_are_judged_from_lablibs_calls_not_from_spans_a_learner_adds(cluster):
    from lablib.checks.lab02 import ring_job, ring_shares

    n = cluster.world_size
    shares = ring_shares("all_gather", n)
    for got, sent, collectives in cluster.run(ring_job, _ring_with_a_made_up_span, "all_gather", shares)[0]:
        assert len(sent) == n - 1 and 12345 not in sent and collectives == []
