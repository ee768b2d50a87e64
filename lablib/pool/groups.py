"""The process groups a job makes (``dist.new_group``, ``init_device_mesh``, ...): the pool's timeout, and the
same groups on every rank in the same order, or an error that says so at once.

Creating a group is collective over the whole default group, even on the ranks it leaves out: torch names an
unnamed group after a counter every rank keeps for itself (``_world.group_count``) and its members meet under
that name in the store. A rank that skips a group (makes only those that hold it, the commonest mistake) or
makes them in another order shifts its counter, and then either

- waits inside Gloo's connection of the group for peers that never come, for c10d's default timeout of new
  groups (30 minutes, not the pool's: ``distributed_c10d.default_pg_timeout``), or
- connects to ranks that made *another* group under the same name: the collectives on it then run between
  the wrong ranks, and may return a wrong sum without any error.

So on a rank of a pool (``install``) every such group is first announced in the store, under its counter, with
its ranks, and made only once every rank announced the same; the announcement that differs, or the rank that
made none within the pool's timeout, is named with the rule it broke. And every group made without a timeout
of its own gets the pool's, Gloo's and NCCL's alike, so a collective on a group that one of its members never
joins fails within the pool's timeout as on the default group.
"""
from __future__ import annotations

import datetime
import json
import time

RULE = ("every rank must create every group, in the same order (dist.new_group is collective over the whole "
        "default group, even for groups this rank is not in): make all of them on every rank, and keep those "
        "that hold this rank")


class GroupMismatch(RuntimeError):
    """The ranks did not make the same process group: another one, or none, at the same point."""


class _State:
    timeout_s = None  # the pool's timeout while installed
    first = 0         # the counter at the start of the job in flight: groups are numbered from it
    original = None   # distributed_c10d._new_group_with_tag, as torch has it


def install(timeout_s: float) -> None:
    """On a rank: new groups get ``timeout_s`` unless given one, and are checked alike on every rank."""
    import torch.distributed.distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout  # read by _get_default_timeout for a group made with timeout=None
    c10d.default_pg_nccl_timeout = timeout
    _State.timeout_s = timeout_s
    if _State.original is None:
        _State.original = c10d._new_group_with_tag  # what new_group, new_subgroups and DeviceMesh all call
        c10d._new_group_with_tag = _checked


def job_started() -> None:
    """Number this job's groups from 1 (the counter runs on over the jobs of one process group)."""
    _State.first = _count()


def _count() -> int:
    import torch.distributed.distributed_c10d as c10d

    return int(getattr(c10d._world, "group_count", 0)) if c10d.is_initialized() else 0


def _checked(*args, **kwargs):
    import inspect

    call = inspect.signature(_State.original).bind(*args, **kwargs)
    call.apply_defaults()
    ranks, given = call.arguments.get("ranks"), call.arguments
    if not given.get("use_local_synchronization"):  # a group named by a hash of its ranks, made by its members
        try:                                         # only, is exempt
            mine = None if ranks is None else (sorted if given.get("sort_ranks", True) else list)(int(r) for r in ranks)
        except (TypeError, ValueError):  # not a list of ranks: torch's own error says so
            return _State.original(*args, **kwargs)
        agree(mine)
    return _State.original(*args, **kwargs)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _show(ranks) -> str:
    return "all ranks (ranks=None)" if ranks is None else str(ranks)


def agree(mine) -> None:
    """Announce the group about to be made (``mine``: its ranks, None for all) under the counter's next name, and
    wait until every rank of the default group announced one there: the same, or ``GroupMismatch`` naming who
    made what."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    me, world, count = dist.get_rank(), dist.get_world_size(), _count()
    store = c10d._get_default_store()
    prefix = f"lablib-new-group/{count}/"
    store.set(prefix + str(me), json.dumps(mine))
    keys = [prefix + str(r) for r in range(world)]
    nth = f"the {_ordinal(count - _State.first + 1)} group this job made"
    end, pause = time.monotonic() + (_State.timeout_s or 1800.0), 0.0005
    # Polled, not store.wait: a wait that times out logs a warning, and a sleep lets the stop button in.
    while not store.check(keys):
        if time.monotonic() > end:
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise GroupMismatch(
                f"dist.new_group({_show(mine)}), {nth}: rank(s) {', '.join(map(str, missing))} made no group at this "
                f"point within {_State.timeout_s:g} s (they made fewer groups, or are in another collective); "
                f"{RULE}.")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    made = {r: json.loads(store.get(k)) for r, k in enumerate(keys)}
    if len({json.dumps(v) for v in made.values()}) > 1:
        by = {}
        for r, v in made.items():
            by.setdefault(json.dumps(v), []).append(r)
        said = "; ".join(f"rank(s) {', '.join(map(str, rs))} made {_show(json.loads(v))}" for v, rs in by.items())
        raise GroupMismatch(f"{nth} differs across the ranks: {said}. The ranks' groups no longer match from here "
                            f"on: {RULE}.")
