"""Lab 09's answers: mixed precision on FSDP's units (cast, gather, reduce in the policy's dtype), loss scaling
that every rank agrees on, gradient accumulation with one all-reduce, and a sharded checkpoint loaded at another
world size (the harness is ``strategies.mixed``, ``strategies.accumulate`` and ``strategies.checkpoint``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

TASKS = {"Task 9.1": ("mp_unshard", "mp_reduce"), "Task 9.2": ("scaled_update",), "Task 9.3": ("accumulate",),
         "Task 9.4": ("save_shard", "load_shard")}


def mp_unshard(unit, policy) -> None:
    """The unit's parameters whole in ``policy.param_dtype``: the fp32 shard cast first, then all-gathered."""
    unit.flat.untyped_storage().resize_(unit.layout.padded_numel * unit.flat.element_size())
    comm.all_gather(unit.flat, unit.master.to(policy.param_dtype), name="all_gather params")


def mp_reduce(unit, grad, policy, ctx) -> None:
    """This rank's shard of the averaged gradient, fp32, in ``unit.grad``: reduce-scattered in ``reduce_dtype``."""
    out = torch.empty(unit.layout.shard_numel, dtype=policy.reduce_dtype, device=grad.device)
    comm.reduce_scatter(out, grad.to(policy.reduce_dtype), name="reduce_scatter grads")
    unit.grad = out.float() / ctx.world_size


def scaled_update(grad, scaler, step) -> bool:
    """Unscale; skip on every rank if any rank's shard overflowed (the flag all-reduced with MAX); the scale
    halved on a skip and doubled after ``growth_interval`` good steps in a row. Returns whether it stepped."""
    unscaled = grad.float() / scaler.scale
    found = torch.tensor([0.0 if torch.isfinite(unscaled).all() else 1.0], device=grad.device)
    comm.all_reduce(found, op=dist.ReduceOp.MAX, name="found inf")
    if found.item() > 0:
        scaler.scale *= scaler.backoff
        scaler.good = 0
        return False
    step(unscaled)
    scaler.good += 1
    if scaler.good == scaler.growth_interval:
        scaler.scale *= scaler.growth
        scaler.good = 0
    return True


def accumulate(model, micro_batches, loss_fn) -> None:
    """The gradient of the mean loss over every rank's micro-batches in each ``p.grad``: the micro-batches'
    gradients (of loss / k) add up locally, and one all-reduce per parameter follows the last."""
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    for p in model.parameters():
        comm.all_reduce(p.grad, name="all_reduce grads")
        p.grad /= dist.get_world_size()


def save_shard(folder, name, shard, start, numel) -> None:
    """This rank's values of tensor ``name`` (the padding past ``numel`` left out), placed by its metadata."""
    count = max(0, min(shard.numel(), numel - start))
    folder.write(f"{name}.{start}", shard[:count], name=name, start=start, numel=numel)


def load_shard(folder, name, rank, world_size):
    """This rank's shard of ``name`` at ``world_size`` (ceil(numel / world_size) values, zeros past the end),
    read only where a saved file overlaps it."""
    files = [e for e in folder.entries() if e.get("name") == name]
    numel = files[0]["numel"]
    size = -(-numel // world_size)
    lo, hi = rank * size, (rank + 1) * size
    out = torch.zeros(size, device=comm.device())
    for e in files:
        a, b = max(lo, e["start"]), min(hi, e["start"] + e["count"])
        if a < b:
            out[a - lo:b - lo] = folder.read(e["key"], a - e["start"], b - a)
    return out
