"""Lab 03's answers: FSDP's hooks, without and with prefetching, and the reduce-scatter overlapped with
the backward (the loop that calls them, ``train``, is in ``strategies.prefetch``)."""
from __future__ import annotations

import torch

from .. import comm
from ..strategies.prefetch import Hooks
from .lab01 import reshard

TASKS = {"Task 3.1": ("unshard", "reshard", "pre_forward", "post_forward", "pre_backward", "post_backward"),
         "Task 3.2": ("start_gather", "wait_for", "prefetch_forward", "keep_last_post_forward", "prefetch_backward"),
         "Task 3.3": ("overlap_post_backward", "finish")}


def unshard(unit) -> None:
    unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
    comm.all_gather(unit.flat, unit.shard, group=unit.group, name="all_gather params")


def pre_forward(units, i, ctx):
    unshard(units[i])


def post_forward(units, i, ctx):
    reshard(units[i])


def pre_backward(units, i, ctx):
    unshard(units[i])


def post_backward(units, i, ctx):
    unit = units[i]
    full = unit.full_grad()
    unit.grad = torch.empty(unit.layout.shard_numel, device=full.device)
    comm.reduce_scatter(unit.grad, full, group=unit.group, name="reduce_scatter grads")
    unit.grad /= ctx.world_size
    reshard(unit)


def start_gather(unit) -> None:
    """Start the unit's all-gather unless it is gathered or on its way already."""
    if unit.flat.untyped_storage().nbytes() == 0:
        unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
        unit.work = comm.all_gather(unit.flat, unit.shard, async_op=True, group=unit.group, name="all_gather params")


def wait_for(unit) -> None:
    if unit.work is not None:
        unit.work.wait()
        unit.work = None


def keep_last_post_forward(units, i, ctx):
    if i < len(units) - 1:  # the last unit's backward comes right after its forward: keep it whole
        reshard(units[i])


def prefetch_forward(units, i, ctx):
    for j in range(i, min(i + ctx.depth, len(units) - 1) + 1):  # i first: the others queue behind it
        start_gather(units[j])
    wait_for(units[i])


def prefetch_backward(units, i, ctx):
    for j in range(i, max(i - ctx.depth, 0) - 1, -1):
        start_gather(units[j])
    wait_for(units[i])


def overlap_post_backward(units, i, ctx):
    unit = units[i]
    full = unit.full_grad()
    unit.grad = torch.empty(unit.layout.shard_numel, device=full.device)
    unit.work = comm.reduce_scatter(unit.grad, full, async_op=True, group=unit.group, name="reduce_scatter grads")
    reshard(unit)


def finish(units, ctx):
    for unit in units:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
            unit.grad /= ctx.world_size


PLAIN = Hooks(pre_forward, post_forward, pre_backward, post_backward)
PREFETCH = Hooks(prefetch_forward, keep_last_post_forward, prefetch_backward, overlap_post_backward, finish)
