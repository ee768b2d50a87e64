"""Lab 01's answers: a padded flat buffer's shards, and the ZeRO stages' steps (the harness that runs them,
with the flat buffers of ``strategies.flat``, is in ``strategies.zero`` and ``strategies.fsdp``)."""
from __future__ import annotations

import torch

from .. import comm
from ..strategies.fsdp import ZeRO3
from ..strategies.zero import DP, ZeRO1, ZeRO2

TASKS = {"Task 1.1": ("flat_shard",), "Task 1.2": ("shard_slices",), "Task 1.3": ("zero1_step",),
         "Task 1.4": ("zero2_step",), "Task 1.5": ("unshard", "reshard")}


def flat_shard(flat, world_size, rank):
    shard = -(-flat.numel() // world_size)  # ceil: the last shards carry the padding
    padded = torch.zeros(shard * world_size, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    return padded[rank * shard:(rank + 1) * shard]


def shard_slices(numels, world_size, rank):
    """[(param, param_start, shard_start, length), ...]: which elements of which parameter rank's shard holds."""
    shard = -(-sum(numels) // world_size)
    start, end = rank * shard, (rank + 1) * shard
    out, offset = [], 0
    for i, n in enumerate(numels):
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            out.append((i, lo - offset, lo - start, hi - lo))
        offset += n
    return out


def zero1_step(unit, ctx) -> None:
    """ZeRO-1: the full gradient everywhere, but each rank updates (and keeps optimizer state for) only
    its shard, then the updated shards are gathered so every rank has all parameters again."""
    comm.all_reduce(unit.grad, group=unit.group, name="all_reduce grads")
    unit.grad /= ctx.world_size
    start, end = unit.layout.shard_bounds(ctx.rank)
    ctx.update(unit, unit.grad[start:end])
    comm.all_gather(unit.flat, unit.shard, group=unit.group, name="all_gather params")


def zero2_step(unit, ctx) -> None:
    """ZeRO-2: reduce-scatter leaves each rank the summed gradient of its shard only; the full gradient
    is dropped. Then as ZeRO-1: update the shard, gather the parameters."""
    shard_grad = torch.empty(unit.layout.shard_numel, dtype=unit.grad.dtype, device=unit.grad.device)
    comm.reduce_scatter(shard_grad, unit.grad, group=unit.group, name="reduce_scatter grads")
    unit.grad = shard_grad / ctx.world_size
    ctx.update(unit, unit.grad)
    comm.all_gather(unit.flat, unit.shard, group=unit.group, name="all_gather params")


def unshard(unit, ctx) -> None:
    """Make the unit's full parameters exist: allocate the flat buffer, gather every rank's shard."""
    unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
    comm.all_gather(unit.flat, unit.shard, group=unit.group, name="all_gather params")


def reshard(unit) -> None:
    """Free the full parameters; only this rank's shard remains (the module's views stay valid and see
    the data again after the next unshard)."""
    unit.flat.untyped_storage().resize_(0)


STAGES = (DP(), ZeRO1(zero1_step), ZeRO2(zero2_step), ZeRO3(unshard, reshard))  # the four stages lab 01 compares
