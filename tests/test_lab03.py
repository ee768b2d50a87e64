"""Lab 03 (prefetch and overlap): FSDP units driven by hooks against the single-process reference and
FSDP2, what prefetching holds at each depth, the simulated link against its α-β model, Gloo's
asynchronous reduce-scatter, and Tasks 3.1-3.3's checks on right answers and typical mistakes."""
import re
import time

import pytest
import torch

import lablib
from lablib import comm
from lablib.checks import PASSED, CheckFailed
from lablib.checks.lab03 import check_hooks, check_overlap, check_prefetch, prefetch_expect, yours
from lablib.answers import lab03 as answers
from lablib.strategies import fsdp, prefetch
from lablib.strategies.harness import reference


# -- a learner's answers (defined here: checks refuse lablib's own functions) ------------------------------
def unshard(unit):
    unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
    lablib.all_gather(unit.flat, unit.shard)


def reshard(unit):
    unit.flat.untyped_storage().resize_(0)


def pre(units, i, ctx):
    unshard(units[i])


def post(units, i, ctx):
    reshard(units[i])


def post_backward(units, i, ctx):
    unit = units[i]
    full = unit.full_grad()
    unit.grad = torch.empty(unit.layout.shard_numel)
    lablib.reduce_scatter(unit.grad, full)
    unit.grad /= ctx.world_size
    reshard(unit)


def start(unit):
    if unit.flat.untyped_storage().nbytes() == 0:
        unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
        unit.work = lablib.all_gather(unit.flat, unit.shard, async_op=True)


def wait(unit):
    if unit.work is not None:
        unit.work.wait()
        unit.work = None


def forward_ahead(units, i, ctx):
    for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
        start(units[j])
    wait(units[i])


def keep_last(units, i, ctx):
    if i < len(units) - 1:
        reshard(units[i])


def backward_ahead(units, i, ctx):
    for j in range(i, max(i - ctx.depth, 0) - 1, -1):
        start(units[j])
    wait(units[i])


def rs_async(units, i, ctx):
    unit = units[i]
    full = unit.full_grad()
    unit.grad = torch.empty(unit.layout.shard_numel)
    unit.work = lablib.reduce_scatter(unit.grad, full, async_op=True)
    reshard(unit)


def finish(units, ctx):
    for unit in units:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
            unit.grad /= ctx.world_size


# -- the library ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_hooked_fsdp_matches_the_reference_at_every_depth(cluster, model):
    ref = reference(model, 3, cluster.world_size)
    for hooks, depth in ((answers.PLAIN, 0), (answers.PREFETCH, 0), (answers.PREFETCH, 1), (answers.PREFETCH, 2)):
        for rank, result in enumerate(cluster.run(prefetch.train, hooks, model, 3, depth=depth)):
            err = max((got - want).abs().max().item() for got, want in zip(result["params"], ref))
            assert err <= 1e-6, (model, depth, rank, err)
            assert result["held"]["params"] == sum(b // cluster.world_size for b in result["unit_bytes"])


def test_fsdp2_with_prefetching_matches_the_reference(cluster):
    ref = fsdp.unflatten("mlp", reference("mlp", 3, cluster.world_size))
    for depth in (0, 1):
        for rank, result in enumerate(cluster.run(prefetch.fsdp2_train, "mlp", 3, depth)):
            assert max((full - ref[name]).abs().max().item() for name, full in result["params"]) <= 1e-6, rank


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetching_holds_depth_plus_one_units_and_follows_the_expected_log(cluster, depth):
    results = cluster.run(prefetch.train, answers.PREFETCH, "transformer8", 1, depth=depth)
    units = len(results[0]["unit_bytes"])
    expect = prefetch_expect(units, depth)
    for r in results:
        assert max(len(e["gathered"]) for e in r["log"]) == depth + 1
        assert r["peak"] == max(sum(r["unit_bytes"][j] for j in e["gathered"]) for e in r["log"])
        for e in r["log"]:
            if e["moment"] in ("pre_forward", "post_forward"):  # the backward also has reduce-scatters in flight
                want_gathered, want_pending = expect(e["moment"], e["unit"])
                assert sorted(e["gathered"]) == sorted(want_gathered)
                assert sorted((j, op) for j, op, _, _ in e["pending"]) == sorted(want_pending)


def test_prefetching_puts_communication_under_compute_on_a_simulated_link(cluster):
    link = comm.LINKS["2.5GbE"]
    plain = prefetch.measure(cluster, answers.PLAIN, 0, link, model_name="transformer8", steps=1)
    ahead = prefetch.measure(cluster, answers.PREFETCH, 1, link, model_name="transformer8", steps=1)
    assert plain["hidden"] == 0.0  # synchronous collectives never run under compute
    assert ahead["hidden"] > 0.0   # a prefetched gather is in flight while the unit before it computes
    assert all(s.meta.get("simulated") == link.name for s in ahead["timeline"].spans if s.kind == "comm")


def test_the_link_model_is_lab_02s():
    link = comm.Link("test", alpha=1e-3, beta=1e6)
    assert link.seconds("all_gather", 1000, 4) == pytest.approx(3 * 1e-3 + 0.75 * 4000 / 1e6)
    assert link.seconds("reduce_scatter", 4000, 4) == pytest.approx(3 * 1e-3 + 0.75 * 4000 / 1e6)
    assert link.seconds("all_reduce", 4000, 2) == pytest.approx(2 * 1e-3 + 1.0 * 4000 / 1e6)
    assert "α = 1000 µs" in str(link)


def _over_a_link(link_alpha, link_beta):
    import torch.distributed as dist

    from lablib.timeline import CLOCK, RECORDER

    link = comm.Link("test", link_alpha, link_beta)
    n, rank = dist.get_world_size(), dist.get_rank()
    dist.barrier()
    with comm.simulated(link):
        out = torch.empty(4 * n)
        comm.all_gather(out, torch.full((4,), float(rank)), name="sync")
        a = comm.all_gather(torch.empty(1000 * n), torch.ones(1000), async_op=True, name="first")
        b = comm.reduce_scatter(torch.empty(1000), torch.ones(1000 * n), async_op=True, name="second")
        b.wait()
        a.wait()
        paused = CLOCK.paused
    spans = {s.name: (s.t1 - s.t0) / 1e9 for s in RECORDER.spans if s.kind == "comm"}
    ends = {s.name: s.t1 for s in RECORDER.spans if s.kind == "comm"}
    return {"values": out, "spans": spans, "gap": (ends["second"] - ends["first"]) / 1e9, "paused": paused,
            "after": CLOCK.paused, "model": {name: link.seconds(op, nbytes, n) for name, op, nbytes in (
                ("sync", "all_gather", 16), ("first", "all_gather", 4000), ("second", "reduce_scatter", 4000 * n))}}


def test_a_simulated_link_keeps_values_real_and_takes_the_modelled_time(cluster):
    n = cluster.world_size
    for rank, r in enumerate(cluster.run(_over_a_link, 2e-3, 2e6)):
        assert torch.equal(r["values"], torch.arange(n).repeat_interleave(4).float())
        for name, seconds in r["spans"].items():
            assert r["model"][name] - 1e-9 <= seconds < r["model"][name] + 5, (rank, name)  # 5 s: finished, not hung
        assert r["gap"] >= r["model"]["second"] - 1e-6  # one collective at a time on the link
        assert r["paused"] > 0 and r["after"] == 0       # the real transfers were off the clock, then reset


def _gloo_async_reduce_scatter():
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    full = torch.arange(8 * n, dtype=torch.float32) * (rank + 1)
    out = torch.empty(8)
    work = comm.reduce_scatter(out, full, async_op=True)
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    done = work.is_completed()
    work.wait()
    return done, out, full


def test_gloo_runs_an_async_reduce_scatter_before_it_is_waited_for(cluster):
    n = cluster.world_size
    for rank, (done, out, full) in enumerate(cluster.run(_gloo_async_reduce_scatter)):
        assert done, "Gloo's own reduce-scatter only progresses in wait(); lablib's must not"
        want = sum(torch.arange(8 * n, dtype=torch.float32) * (r + 1) for r in range(n))[8 * rank:8 * rank + 8]
        assert torch.equal(out, want) and torch.equal(full, torch.arange(8 * n, dtype=torch.float32) * (rank + 1))


def _free_while_in_flight():
    import torch.distributed as dist

    out = torch.empty((1 << 18) * dist.get_world_size())
    work = comm.all_gather(out, torch.ones(1 << 18), async_op=True)
    out.untyped_storage().resize_(0)  # the mistake: freed before the gather landed
    time.sleep(0.05)
    try:
        work.wait()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_freeing_a_buffer_while_its_gather_is_in_flight_is_an_error_not_a_crash(cluster):
    for message in cluster.run(_free_while_in_flight):
        assert "freed" in message and "Wait for a unit's gather before freeing it" in message


# -- the checks ----------------------------------------------------------------------------------------------
def test_right_answers_pass_every_check(cluster):
    check_hooks(pre, post, pre, post_backward, cluster)
    check_prefetch(forward_ahead, keep_last, backward_ahead, post_backward, cluster)
    check_overlap(rs_async, finish, forward_ahead, keep_last, backward_ahead, cluster)


def _fails(check, *fns, cluster):
    with pytest.raises(CheckFailed) as err:
        check(*fns, cluster)
    return str(err.value)


def test_hook_mistakes_are_named(cluster):
    def keep(units, i, ctx):
        pass

    def no_average(units, i, ctx):
        unit = units[i]
        full = unit.full_grad()
        unit.grad = torch.empty(unit.layout.shard_numel)
        lablib.reduce_scatter(unit.grad, full)
        reshard(unit)

    assert "should be none, yours: [0]" in _fails(check_hooks, pre, keep, pre, post_backward, cluster=cluster)
    assert "resize the storage back" in _fails(check_hooks, pre, post, keep, post_backward, cluster=cluster)
    assert "divide it by the world size" in _fails(check_hooks, pre, post, pre, no_average, cluster=cluster)

    def whole_gradient(units, i, ctx):  # keeps the full gradient: no reduce-scatter
        units[i].grad = units[i].full_grad() / ctx.world_size
        reshard(units[i])

    def full_grad_twice(units, i, ctx):
        unit = units[i]
        unit.grad = torch.empty(unit.layout.shard_numel)
        lablib.reduce_scatter(unit.grad, unit.full_grad() if unit.full_grad() is not None else None)
        unit.grad /= ctx.world_size
        reshard(unit)

    text = _fails(check_hooks, pre, post, pre, whole_gradient, cluster=cluster)
    assert "Likely: unit.grad must hold this rank's shard only" in text and "the whole (padded) gradient" in text, text
    text = _fails(check_hooks, pre, post, pre, full_grad_twice, cluster=cluster)
    assert "Likely: call unit.full_grad() once per backward" in text, text

    def gather_unsized(units, i, ctx):  # all-gathers into the freed buffer: no resize_ first
        lablib.all_gather(units[i].flat, units[i].shard)

    text = _fails(check_hooks, gather_unsized, post, pre, post_backward, cluster=cluster)
    assert text.startswith("Task 3.1: your function failed on the ranks. Likely: your pre_forward hook "
                           "(gather_unsized) all-gathered into a unit's flat buffer while its storage was freed"), text
    assert "a unit computed" not in text


def test_prefetch_mistakes_are_named(cluster):
    def wait_all(units, i, ctx):
        for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
            start(units[j])
        for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
            wait(units[j])

    def too_far(units, i, ctx):
        for j in range(i, min(i + ctx.depth + 1, len(units) - 1) + 1):
            start(units[j])
        wait(units[i])

    def decoy(units, i, ctx):  # gathers synchronously, and keeps a tiny async gather in unit.work for show
        for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
            if units[j].flat.untyped_storage().nbytes() == 0:
                unshard(units[j])
                units[j].work = lablib.all_gather(torch.empty(ctx.world_size), torch.zeros(1), async_op=True)
        wait(units[i])

    assert "must still be in flight" in _fails(check_prefetch, wait_all, keep_last, backward_ahead, post_backward, cluster=cluster)
    assert "into no unit's buffer" in _fails(check_prefetch, decoy, keep_last, backward_ahead, post_backward, cluster=cluster)

    def twice(units, i, ctx):  # no guard: a prefetched unit is gathered again when its turn comes
        for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
            units[j].flat.untyped_storage().resize_(units[j].layout.padded_numel * units[j].flat.element_size())
            wait(units[j])
            units[j].work = lablib.all_gather(units[j].flat, units[j].shard, async_op=True)
        wait(units[i])

    def stale(units, i, ctx):
        for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
            start(units[j])
        units[i].work.wait() if units[i].work is not None else None

    assert "gathered once per use" in _fails(check_prefetch, twice, keep_last, backward_ahead, post_backward, cluster=cluster)
    assert "set unit.work = None after waiting" in _fails(check_prefetch, stale, keep_last, backward_ahead, post_backward,
                                                          cluster=cluster)
    def backward_the_forwards_way(units, i, ctx):
        for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):
            start(units[j])
        wait(units[i])

    assert re.search(r"the units holding their full parameters should be \[1, 2\], yours: \[2\]\. The backward runs "
                     r"the units last to first, so at unit i prefetch_backward gathers i, i-1, \.\.\., i-depth: here "
                     r"units 2, 1\. Yours gathers the forward's way, i, i\+1, \.\.\.: at pre_backward of unit 1 it "
                     "gathered unit 2", _fails(check_prefetch, forward_ahead, keep_last, backward_the_forwards_way, post_backward,
                                               cluster=cluster))
    assert "exactly ctx.depth" in _fails(check_prefetch, too_far, keep_last, backward_ahead, post_backward, cluster=cluster)
    assert "yours: none" in _fails(check_prefetch, forward_ahead, post, backward_ahead, post_backward, cluster=cluster)


def test_overlap_mistakes_are_named(cluster):
    def no_divide(units, ctx):
        for unit in units:
            wait(unit)

    assert "unit" in _fails(check_overlap, post_backward, finish, forward_ahead, keep_last, backward_ahead, cluster=cluster)  # synchronous: nothing in flight
    assert "divide" in _fails(check_overlap, rs_async, no_divide, forward_ahead, keep_last, backward_ahead, cluster=cluster)

    def rebinds(units, i, ctx):  # a new tensor in unit.grad while the reduce-scatter writes into the old one
        rs_async(units, i, ctx)
        units[i].grad = units[i].grad / ctx.world_size

    assert "writes into a tensor that is no longer unit.grad" in _fails(check_overlap, rebinds, no_divide, forward_ahead, keep_last, backward_ahead,
                                                                           cluster=cluster)


def test_what_a_learner_might_try_instead_of_the_work_is_refused(cluster):
    def through_a_default(units, i, ctx, lib=lablib):  # lablib's own answers, reached through a default
        lib.strategies.prefetch.pre_forward(units, i, ctx)

    def replay(units, i, ctx):  # a finished handle made to look in flight
        unshard(units[i])
        for j in range(i + 1, min(i + ctx.depth, len(units) - 1) + 1):
            start(units[j])
            units[j].work.wait()
            units[j].work.waited = False

    def stash(units, i, ctx):  # keep a copy instead of gathering again
        units[i].copy = units[i].flat.clone()
        reshard(units[i])

    with pytest.raises(CheckFailed, match="as a value"):
        check_hooks(through_a_default, post, pre, post_backward, cluster)
    assert "can't set attribute" in _fails(check_prefetch, replay, keep_last, backward_ahead, post_backward, cluster=cluster) \
        or "has no setter" in _fails(check_prefetch, replay, keep_last, backward_ahead, post_backward, cluster=cluster)
    assert "copy" in _fails(check_hooks, pre, stash, pre, post_backward, cluster=cluster)


def test_hidden_checks_train_other_weights_and_data(cluster):
    assert not torch.equal(reference("mlp", 3, 2, seed=7)[0], reference("mlp", 3, 2)[0])
    check_hooks(pre, post, pre, post_backward, cluster, seed=7)
    check_overlap(rs_async, finish, forward_ahead, keep_last, backward_ahead, cluster, seed=7)


def test_untraced_collectives_are_refused():
    import torch.distributed as dist

    def untraced(units, i, ctx):
        unit = units[i]
        unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
        dist.all_gather_into_tensor(unit.flat, unit.shard)

    with pytest.raises(CheckFailed, match="traced"):
        check_hooks(untraced, post, pre, post_backward, world_size=2)


def test_yours_uses_a_learners_hooks_only_once_their_check_passed(capsys):
    PASSED.discard("Task 3.1")
    plain, ahead = yours(pre_forward=pre, post_forward=post, pre_backward=pre, post_backward=post_backward)
    assert plain == answers.PLAIN and "lablib's functions (Task 3.1" in capsys.readouterr().out
    PASSED.add("Task 3.1")
    try:
        plain, ahead = yours(pre_forward=pre, post_forward=post, pre_backward=pre, post_backward=post_backward)
        assert plain.pre_forward is pre and ahead.pre_forward is answers.prefetch_forward
        assert "your functions of Task 3.1; lablib's for Task 3.2, Task 3.3" in capsys.readouterr().out
    finally:
        PASSED.discard("Task 3.1")
    with pytest.raises(TypeError, match="yours\\(\\) takes"):
        yours(pre_froward=pre)


def summing_post_backward(units, i, ctx):  # Task 3.1's mistake: the shard summed over ranks, never averaged
    unit = units[i]
    full = unit.full_grad()
    unit.grad = torch.empty(unit.layout.shard_numel)
    lablib.reduce_scatter(unit.grad, full)
    reshard(unit)


def test_a_later_check_says_when_an_earlier_tasks_function_may_be_to_blame(cluster):
    PASSED.discard("Task 3.1")
    message = _fails(check_prefetch, forward_ahead, keep_last, backward_ahead, summing_post_backward, cluster=cluster)
    assert "Task 3.2's check runs your functions of Task 3.1 too" in message
    PASSED.add("Task 3.1")
    try:  # once Task 3.1 has passed, the message is the check's own
        assert "has not passed" not in _fails(check_prefetch, forward_ahead, keep_last, backward_ahead,
                                              summing_post_backward, cluster=cluster)
    finally:
        PASSED.discard("Task 3.1")
