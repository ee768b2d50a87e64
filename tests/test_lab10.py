"""Lab 10 (finding bugs): the broken steps break as they say, PyTorch's own Flight Recorder records the same
collectives as lablib's on Gloo, and Tasks 10.1-10.4's checks pass right detectors and name each mistake,
on hidden variants (another parameter, rank, factor) that a detector of the notebook's cases only misses."""
import pytest
import torch
import torch.distributed as dist

import lablib
from lablib.checks import CheckFailed, NotDone
from lablib.checks.lab10 import check_diverged, check_factor, check_first_mismatch, check_probe
from lablib.pool import Cluster
from lablib.strategies import bugs, hangs, probe


# -- a learner's detectors (lablib's own are refused by the checks) ---------------------------------------
def _bits(t):
    b = t.detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
    return (b * torch.arange(1, b.numel() + 1)).sum()


def _gather_and_name(named, checksum):
    n = dist.get_world_size()
    mine = torch.stack([checksum(p) for _, p in named])
    every = torch.empty(n * len(named), dtype=mine.dtype)
    lablib.all_gather(every, mine)
    every = every.view(n, -1)
    for i, (name, _) in enumerate(named):
        ranks = [r for r in range(n) if every[r, i] != every[0, i]]
        if ranks:
            return name, ranks
    return None


def diverged(named):
    return _gather_and_name(named, _bits)


def float_sum(named):
    return _gather_and_name(named, lambda p: p.detach().sum())


def value_sum(named):
    return _gather_and_name(named, lambda p: p.detach().view(-1).view(torch.int32).to(torch.int64).sum())


def whole(named):
    n = dist.get_world_size()
    for name, p in named:
        every = torch.empty(n * p.numel())
        lablib.all_gather(every, p.detach().reshape(-1))
        ranks = [r for r, q in enumerate(every.view(n, -1)) if not torch.equal(q, every.view(n, -1)[0])]
        if ranks:
            return name, ranks
    return None


def mine_only(named):  # each rank names itself when its checksum differs from the sum's share
    n, r = dist.get_world_size(), dist.get_rank()
    for name, p in named:
        s = _bits(p).double()
        total = s.clone()
        lablib.all_reduce(total)
        if s * n != total:
            return name, [r]
    return None


def factor(got, want):
    got, want = got.double().flatten(), want.double().flatten()
    if not want.any():
        return 1.0 if not got.any() else None
    c = float(got @ want / (want @ want))
    return c if (got - c * want).norm() <= 1e-3 * got.norm() else None


def ratio(got, want):
    return float((got / want).mean())


def magnitude(got, want):
    c = factor(got, want)
    return None if c is None else abs(c)


def always(got, want):
    return float(got.norm() / want.norm())


def first_mismatch(flights):
    held = {r: {e[0]: e for e in entries} for r, entries in flights.items()}
    start = max((min(h) for h in held.values() if h), default=None)
    if start is None:
        return None
    for seq in range(start, max(max(h) for h in held.values() if h) + 1):
        at = {r: h.get(seq) for r, h in held.items()}
        if len({None if e is None else e[1:6] for e in at.values()}) > 1:
            return seq, at
    return None


def by_index(flights):
    for i, calls in enumerate(zip(*flights.values())):
        if len({c[1:6] for c in calls}) > 1:
            return calls[0][0], dict(zip(flights, calls))
    return None


def op_and_bytes(flights):
    held = {r: {e[0]: e for e in entries} for r, entries in flights.items()}
    start = max(min(h) for h in held.values() if h)
    for seq in range(start, max(max(h) for h in held.values() if h) + 1):
        at = {r: h.get(seq) for r, h in held.items()}
        if len({None if e is None else e[1:3] for e in at.values()}) > 1:
            return seq, at
    return None


def zeroes_them(named):  # no detector: makes every replica equal, then says so
    for _, p in named:
        p.detach().zero_()
    return None


def overwrites(got, want):  # no measurement: makes the gradient what it is compared with
    got.copy_(want)
    return 1.0


def reduction_error(reduce, x, group):
    n = dist.get_world_size(group)
    every = torch.empty(n * x.numel(), dtype=torch.float64)
    lablib.all_gather(every, x.double(), group=group)
    exact = every.view(n, -1).sum(0)
    return float((reduce(x).double() - exact).norm() / exact.norm())


def against_itself(reduce, x, group):  # the reference made the step's way rounds the same way
    n = dist.get_world_size(group)
    every = torch.empty(n * x.numel())
    lablib.all_gather(every, x, group=group)
    return float((reduce(x) - reduce(every.view(n, -1)[dist.get_group_rank(group, dist.get_rank())].clone())).norm())


def whole_world(reduce, x, group):  # the exact sum over every rank, not the group's
    n = dist.get_world_size()
    every = torch.empty(n * x.numel(), dtype=torch.float64)
    got = reduce(x).double()
    lablib.all_gather(every, x.double())
    exact = every.view(n, -1).sum(0)
    return float((got - exact).norm() / exact.norm())


def largest(reduce, x, group):  # the largest element's error, not the tensor's
    n = dist.get_world_size(group)
    every = torch.empty(n * x.numel(), dtype=torch.float64)
    lablib.all_gather(every, x.double(), group=group)
    exact = every.view(n, -1).sum(0)
    return float(((reduce(x).double() - exact).abs() / exact.abs()).max())


def not_done(*args):
    raise NotImplementedError


# -- the broken steps --------------------------------------------------------------------------------------
def test_each_replica_bug_shows_where_it_says(cluster):
    n = cluster.world_size
    for case in bugs.REPLICA_CASES + bugs.REPLICA_HIDDEN:
        params = [r["params"] for r in cluster.run(bugs.checksum_job, diverged, case, 3)]
        truth = bugs.differing(params)
        if case == "healthy":
            assert truth is None
            continue
        assert truth[1] == (list(range(1, n)) if case in bugs.REPLICA_CASES else [bugs._draws(3, n, 6)[1]]), case
        if case == "one ulp":  # a float sum misses it: the bits differ in one element by one ulp
            name = truth[0]
            a, b = (dict(p)[name] for p in (params[0], params[truth[1][0]]))
            assert (a != b).sum() == 1 and a.sum() == b.sum() and a.norm() == b.norm()
    picks = {bugs._draws(seed, n, 6)[0] for seed in range(12)}
    assert len(picks) > 2  # the seed moves the bug to other parameters


def test_each_gradient_bug_is_the_factor_it_says(cluster):
    n = cluster.world_size
    expect = {"summed": n, "loss scale kept": 2.0 ** 11, "sign flipped": -1.0, "dead units": n}
    for case in bugs.GRADIENT_CASES + bugs.GRADIENT_HIDDEN:
        res = cluster.run(bugs.parity_job, factor, case, 3)
        which = bugs._draws(3, n, 6)[0]
        for got in res:
            for i, said in enumerate(got["said"]):
                want = expect.get(case, 2.0 if case == "expert scale" and i == which else
                                  None if case == "not reduced" and i == which else 1.0)
                assert (said is None) == (want is None) and (want is None or abs(said - want) < 1e-3 * abs(want)), \
                    (case, i, said, want)
    dead = cluster.run(bugs.parity_job, ratio, "dead units", 3)[0]["said"]
    assert any(x != x for x in dead)  # an element-wise ratio is NaN there


def test_every_hang_leaves_each_ranks_record_and_pytorchs_flight_recorder_agrees(cluster):
    n = cluster.world_size
    for case in hangs.CASES + ("dtype",):
        flights = hangs.flights(cluster, case, 1)
        seq, at = first_mismatch(flights)
        assert seq == (2 + hangs.GOOD_STEPS * (1 + len(hangs.SIZES)) if case == "skipped" else 2) and [r for r, e in at.items() if e[1:6] != at[0][1:6]] == [hangs.odd_rank(1, n)], case
    if n != 4:
        return  # the long step waits for a timeout: once is enough
    with Cluster(n, timeout=2.0, quiet=True) as short:
        flights = hangs.flights(short, "one fewer", 1)
    assert first_mismatch(flights)[0] == hangs.LONG + 1 and by_index(flights) is None
    for _ in range(2):  # PyTorch's buffer outlives a job, and a group's name comes back after a failure
        for r, (ours, theirs) in enumerate(cluster.run(hangs.pytorch_record, "one fewer", 1)):
            assert len(theirs) == ours[-1][0] > len(ours) and theirs[-len(ours):] == [(e[1], e[4]) for e in ours], r
        hangs.flights(cluster, "reordered", 1)


def test_only_the_low_precision_axis_rounds(cluster):
    for case, dtypes in {**probe.CASES, **probe.HIDDEN}.items():
        for got in cluster.run(probe.job, reduction_error, case, 2):
            for axis, one in got.items():
                low = axis in dtypes
                assert (one["said"] > 1e-4) == low and one["said"] < (5e-3 if low else 1e-6), (case, axis, one["said"])


def test_a_schedule_written_as_text():
    from lablib.strategies import schedules as sc

    assert sc.from_text(["F0.0 B12.3", ""]) == [[sc.Action("F", 0, 0), sc.Action("B", 12, 3)], []]
    with pytest.raises(ValueError, match=r"rank 1's 'X1.0': expected an action as F, B or W"):
        sc.from_text(["F0.0", "X1.0"])


# -- the checks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("check, fn", [(check_diverged, diverged), (check_factor, factor),
                                       (check_first_mismatch, first_mismatch), (check_probe, reduction_error)])
def test_right_detectors_pass_in_the_notebook_and_on_hidden_variants(cluster, check, fn, capsys):
    check(fn, cluster)
    if cluster.world_size == 4:  # the hidden variants' pool is the same whatever the notebook's
        check(fn, world_size=3, seed=5)
    assert capsys.readouterr().out.count("✓") == 1 + (cluster.world_size == 4)


@pytest.mark.parametrize("check, fn, hidden, says", [
    (check_diverged, float_sum, True, "one ulp, which a float sum rounds away"),
    (check_diverged, value_sum, True, "two of them swapped"),
    (check_diverged, whole, False, "not the parameters themselves"),
    (check_diverged, mine_only, False, "the ranks answered differently"),
    (check_factor, ratio, False, "divides 0 by 0"),
    (check_factor, magnitude, True, "with their signs"),
    (check_factor, always, False, "not a multiple of one process's"),
    (check_first_mismatch, by_index, True, "align the ranks by seq"),
    (check_first_mismatch, op_and_bytes, True, "compare op, bytes, dtype, shape and group"),
    (check_probe, against_itself, False, "a sum made the step's way rounds the same way"),
    (check_probe, whole_world, False, "over the group's ranks only"),
    (check_probe, largest, False, "the relative error of the whole tensor"),
])
def test_each_mistake_is_named(cluster, check, fn, hidden, says):
    if hidden and cluster.world_size != 4:
        pytest.skip("the hidden variants' pool is the same whatever the notebook's: checked once")
    if hidden:
        check(fn, cluster)  # the notebook's cases pass: only a hidden variant shows the mistake
    with pytest.raises(CheckFailed, match=says):
        check(fn, world_size=3, seed=5) if hidden else check(fn, cluster)


@pytest.mark.parametrize("check, fn, says", [
    (check_diverged, zeroes_them, "your diverged said None, but 0.0.weight"),
    (check_factor, overwrites, "is 4× one process's; factor said 1.0"),
])
def test_changing_what_is_judged_gains_nothing(cluster, check, fn, says):
    """The judges see the parameters and gradients as the step made them, not as the learner's function left
    them."""
    if cluster.world_size != 4:
        pytest.skip("the messages name 4 ranks")
    with pytest.raises(CheckFailed, match=says):
        check(fn, cluster)


@pytest.mark.parametrize("check", [check_diverged, check_factor, check_first_mismatch, check_probe])
def test_an_untouched_exercise_is_not_done(cluster, check, monkeypatch):
    monkeypatch.setenv("LABLIB_STRICT", "1")
    with pytest.raises(NotDone):
        check(not_done, cluster)
