"""Lab 10's answers: the detectors that find the bugs of distributed training. A checksum of every replica,
compared across ranks; the factor a gradient is off by against one process; the first point at which the
ranks' flight recorders disagree; a reduction's error against the exact sum (the broken steps are
``strategies.bugs``, ``strategies.hangs`` and ``strategies.probe``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

TASKS = {"Task 10.1": ("diverged",), "Task 10.2": ("factor",), "Task 10.3": ("first_mismatch",),
         "Task 10.4": ("reduction_error",)}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, each weighted by its position, summed in int64 (wrapping around is
    still exact): one ulp anywhere, or two elements swapped, changes it."""
    bits = t.detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
    return (bits * torch.arange(1, bits.numel() + 1, device=t.device)).sum()


def diverged(named):
    """(name, ranks): the first parameter some rank holds other bits of than rank 0, and those ranks; None
    when every replica is the same. The same answer on every rank."""
    n = dist.get_world_size()
    mine = torch.stack([checksum(p) for _, p in named])
    every = torch.empty(n * len(named), dtype=torch.int64, device=mine.device)
    comm.all_gather(every, mine, name="all_gather checksums")
    every = every.view(n, -1)
    for i, (name, _) in enumerate(named):
        ranks = [r for r in range(n) if every[r, i] != every[0, i]]
        if ranks:
            return name, ranks
    return None


def factor(got, want):
    """c when ``got`` is c × ``want`` (to 1e-3 of got's size), else None."""
    got, want = got.double().flatten(), want.double().flatten()
    if not want.any():
        return 1.0 if not got.any() else None
    c = float(got @ want / (want @ want))
    return c if (got - c * want).norm() <= 1e-3 * got.norm() else None


def first_mismatch(flights):
    """(seq, {rank: entry or None}) at the first seq every rank still holds where their collectives differ
    (another op, size, dtype, shape or group; or some rank issued none there); None when they agree."""
    held = {r: {e[0]: e for e in entries} for r, entries in flights.items()}
    start = max((min(h) for h in held.values() if h), default=None)
    if start is None:
        return None
    for seq in range(start, max(max(h) for h in held.values() if h) + 1):
        at = {r: h.get(seq) for r, h in held.items()}
        kinds = {None if e is None else e[1:6] for e in at.values()}
        if len(kinds) > 1:
            return seq, at
    return None


def reduction_error(reduce, x, group):
    """The relative error of ``reduce(x)`` (the step's sum of x over ``group``) against the exact sum of every
    rank's x in the group, made in float64."""
    n = dist.get_world_size(group)
    every = torch.empty(n * x.numel(), dtype=torch.float64, device=x.device)
    comm.all_gather(every, x.double(), group=group, name="all_gather exact")
    exact = every.view(n, -1).sum(0)
    return float((reduce(x).double() - exact).norm() / exact.norm())
