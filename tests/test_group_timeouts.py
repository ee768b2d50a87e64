"""Process groups a job makes on the pool's ranks: a rank that makes other groups than its peers, or fewer, or in
another order, is told the rule it broke ("every rank must create every group, in the same order") at once or
within the pool's timeout, instead of waiting in Gloo's connection of the group for c10d's 30-minute default (or
running its collectives between the wrong ranks); a collective on a group that one of its members never joins
fails within the pool's timeout too. One case per lab that makes groups (lab 08's Task 8.1, through its check).
The time bounds only separate reported from hung (tests/procs.py)."""
import datetime
import math
import time

import pytest
import torch
import torch.distributed as dist
from procs import HUNG

import lablib
from lablib import RankError
from lablib.checks import CheckFailed
from lablib.checks.lab08 import check_mesh

RULE = "every rank must create every group, in the same order (dist.new_group is collective over the whole default group"


@pytest.fixture(scope="module")
def four():
    with lablib.Cluster(4, backend="gloo", timeout=2, quiet=True) as c:
        yield c


def _healthy(pool):
    def sums():
        x = torch.ones(1)
        dist.all_reduce(x)
        row = dist.new_group([0, 1]), dist.new_group([2, 3])
        y = torch.ones(1)
        dist.all_reduce(y, group=row[dist.get_rank() // 2])
        return x.item(), y.item()

    assert pool.run(sums) == [(4.0, 2.0)] * 4


def only_its_own_groups(shape, names):
    """Task 8.1's commonest mistake: dist.new_group called only for the groups that hold this rank."""
    rank = dist.get_rank()
    ranks = torch.arange(math.prod(shape)).reshape(tuple(shape))
    mine = {}
    for d, name in enumerate(names):
        for row in ranks.movedim(d, -1).reshape(-1, shape[d]).tolist():
            if rank in row:
                mine[name] = dist.new_group(row)
    return mine


def test_lab08_task_8_1_with_only_its_own_groups_names_the_rule(four):
    t = time.perf_counter()
    with pytest.raises(CheckFailed) as info:
        check_mesh.collect((only_its_own_groups,), four, None)
    assert time.perf_counter() - t < HUNG
    message = str(info.value)
    assert message.startswith("Task 8.1") and RULE in message, message
    assert "the 1st group this job made differs across the ranks: rank(s) 0, 2 made [0, 2]; rank(s) 1, 3 made " \
           "[1, 3]" in message, message
    _healthy(four)


def _groups_in_another_order():
    """Rows made top-down on even ranks, bottom-up on odd ones: without the check, Gloo connects ranks 0 and 1
    with ranks 2 and 3 under one name, and the row sums come back wrong with no error at all."""
    rows = [[0, 1], [2, 3]]
    made = [dist.new_group(row) for row in (rows[::-1] if dist.get_rank() % 2 else rows)]
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x, group=next(g for g in made if dist.get_rank() in dist.get_process_group_ranks(g)))
    return x.item()


def _fewer_groups():
    """Rank 3 makes the first row's group and not the second, then waits in a collective of its own group."""
    first = dist.new_group([0, 1])
    second = dist.new_group([2, 3]) if dist.get_rank() != 3 else None
    dist.barrier(group=first if dist.get_rank() < 2 else second)


@pytest.mark.parametrize("fn, said", [
    (_groups_in_another_order, "the 1st group this job made differs across the ranks: rank(s) 0, 2 made [0, 1]; "
                               "rank(s) 1, 3 made [2, 3]"),
    (_fewer_groups, "made no group at this point within 2 s|did not get past making a process group")])
def test_a_job_whose_ranks_make_other_groups_names_the_rule(four, fn, said):
    t = time.perf_counter()
    with pytest.raises(RankError) as info:
        four.run(fn)
    assert time.perf_counter() - t < four.timeout + HUNG
    message = str(info.value)
    assert RULE in message and any(part in message for part in said.split("|")), message
    _healthy(four)


def _a_member_calls_another_collective():
    """Rows {0, 1} and {2, 3}; on each row one rank all-reduces and the other broadcasts: every rank waits inside
    a collective on its row's group, none finishes (the pool's 'still running after a rank finished' never
    fires), and only the group's own timeout ends it: c10d's 30 minutes for a group made without one, the
    pool's here."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    x = torch.ones(3)
    if dist.get_rank() % 2:
        dist.broadcast(x, src=dist.get_rank() - 1, group=rows[dist.get_rank() // 2])
    else:
        dist.all_reduce(x, group=rows[dist.get_rank() // 2])


def _timeouts():
    from torch.distributed.distributed_c10d import _get_default_timeout

    return _get_default_timeout("gloo"), _get_default_timeout("nccl")


def test_a_collective_on_a_group_not_every_member_joins_fails_within_the_pools_timeout(four):
    assert four.run(_timeouts)[0] == (datetime.timedelta(seconds=2),) * 2
    t = time.perf_counter()
    with pytest.raises(RankError) as info:
        four.run(_a_member_calls_another_collective)
    assert time.perf_counter() - t < four.timeout + HUNG
    message = str(info.value)
    assert "timed out after 2 s waiting for a peer" in message, message
    assert "every member of a group (dist.new_group) must join each collective on it" in message, message
    _healthy(four)


def _own_groups_with_local_synchronization():
    """use_local_synchronization=True: the group is named after its ranks and made by its members only, which is
    allowed; the check leaves it alone."""
    row = [0, 1] if dist.get_rank() < 2 else [2, 3]
    group = dist.new_group(row, use_local_synchronization=True)
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    return x.item()


def test_groups_made_by_their_members_only_on_purpose_are_not_refused(four):
    assert four.run(_own_groups_with_local_synchronization) == [2.0] * 4
