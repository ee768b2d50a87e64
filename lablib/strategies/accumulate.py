"""Gradient accumulation: k micro-batches, one optimizer step, as if the batch were k times larger.

With replicated parameters (data parallelism) the gradients add up locally over the micro-batches and are
all-reduced once, after the last (DDP's ``no_sync``): k times fewer bytes. With FSDP the parameters are
sharded, so every micro-batch gathers them again; only the reduce-scatter can wait
for the last, and the rank then holds the whole unsharded gradient between micro-batches (FSDP2's
``set_requires_gradient_sync(False)``): bytes saved for memory spent. Each micro-batch's loss is divided by
k, so the sum of their gradients is the gradient of the mean loss over the whole batch.

``job`` runs a learner's ``accumulate(model, micro_batches, loss_fn)`` on the ranks; ``reference`` is the
gradient of one process on every rank's micro-batches at once; ``fsdp_job`` measures FSDP's side.
"""
from __future__ import annotations

import copy

import torch

from .. import comm
from ..toy import batch, build_model, loss_fn


def rank_data(world_size: int, micro_batches: int, seed: int = 0, model_name: str = "mlp") -> list:
    """(the initial model, rank r's micro-batches) for every rank: what each rank is handed."""
    model = build_model(model_name, seed)
    return [(model, [batch(model_name, k, r, seed) for k in range(micro_batches)]) for r in range(world_size)]


def job(fn, share) -> dict:
    """On the ranks: ``fn(model, micro_batches, loss_fn)``; the gradients it left and the collectives it issued."""
    model, micro = copy.deepcopy(share)
    model = comm.to_device(model)
    micro = [comm.to_device(*xy) for xy in micro]
    _, ops = comm.watched(fn, model, micro, loss_fn)
    return {"grads": [None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()],
            "ops": ops, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def sync_each(model, micro_batches, loss_fn) -> None:
    """Accumulation that all-reduces after every micro-batch (what ``no_sync`` avoids), to compare with."""
    import torch.distributed as dist

    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for x, y in micro_batches:
        for p in params:
            p.grad = None
        (loss_fn(model(x), y) / len(micro_batches)).backward()
        for p, t in zip(params, total):
            comm.all_reduce(p.grad, name="all_reduce grads")
            t += p.grad / dist.get_world_size()
    for p, t in zip(params, total):
        p.grad = t


def reference(data) -> list[torch.Tensor]:
    """The gradient of the mean loss over every rank's micro-batches, in one process (all of one size)."""
    model = copy.deepcopy(data[0][0])
    xs = torch.cat([x for _, micro in data for x, _ in micro])
    ys = torch.cat([y for _, micro in data for _, y in micro])
    loss_fn(model(xs), ys).backward()
    return [p.grad for p in model.parameters()]


def fsdp_job(micro_batches: int, sync_each: bool, model_name: str = "wide8") -> dict:
    """On the ranks: one step of FSDP over ``micro_batches`` micro-batches (lablib's gather and reduce-scatter,
    each unit's gradient handled as its backward ends), reduce-scattering every micro-batch (``sync_each``) or
    only the last, the whole gradient kept until then. Returns the bytes each kind of collective took in and the
    most gradient bytes the rank held (kept, accumulated and the unit's just computed)."""
    import torch.distributed as dist

    from ..answers.lab09 import mp_reduce, mp_unshard
    from .harness import Context
    from .mixed import SGD, Policy, step, units_for

    rank, n = dist.get_rank(), dist.get_world_size()
    policy, ctx = Policy(torch.float32, torch.float32), Context(rank, n, SGD)
    units = units_for(comm.to_device(build_model(model_name)), rank, n, SGD, policy)
    kept, shards, held, last = {}, {}, [0], [False]

    def reduce(u, grad, policy, ctx):
        kept[id(u)] = grad if id(u) not in kept else kept[id(u)] + grad
        held[0] = max(held[0], sum(g.nbytes for g in kept.values()) + sum(s.nbytes for s in shards.values()))
        if sync_each or last[0]:
            mp_reduce(u, kept.pop(id(u)), policy, ctx)
            shards[id(u)] = u.grad if id(u) not in shards else shards[id(u)] + u.grad

    sent = {}
    for k in range(micro_batches):
        last[0] = k == micro_batches - 1
        x, y = comm.to_device(*batch(model_name, k, rank))
        _, ops = comm.watched(step, units, x, y, ctx, policy, mp_unshard, reduce, False)
        for kind, nbytes in comm.op_bytes(ops).items():
            sent[kind] = sent.get(kind, 0) + nbytes
    return {"bytes": sent, "held_grad_bytes": held[0]}
