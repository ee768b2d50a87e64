"""Lab 08's answers: a mesh's process groups, one composed training step (data, tensor and pipeline
parallel at once, on lablib's ``strategies.compose.Kit``), activation recomputation, and the memory a
layout needs per GPU (the planner that uses it is ``strategies.planner``)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm

TASKS = {"Task 8.1": ("mesh_groups",), "Task 8.2": ("train_step",), "Task 8.3": ("Recompute", "checkpointed"),
         "Task 8.4": ("memory_per_gpu",)}


def mesh_groups(shape, names):
    """{name: this rank's process group along that dimension} of a mesh of sizes ``shape``, ranks laid out
    row-major (the last dimension's ranks consecutive). Every rank makes every group, in the same order."""
    rank = dist.get_rank()
    ranks = torch.arange(math.prod(shape)).reshape(tuple(shape))
    mine = {}
    for d, name in enumerate(names):
        for row in ranks.movedim(d, -1).reshape(-1, shape[d]).tolist():
            group = dist.new_group(row)
            if rank in row:
                mine[name] = group
    return mine


def train_step(kit, x, y, groups, micro_batches):
    """One step on this rank: its data-parallel share of the global batch (x, y) in micro-batches through
    the pipeline, each block's MLP tensor-parallel; the gradients summed over the data-parallel ranks, the
    loss scaled so that they are the global batch's. Returns the global batch's loss."""
    dp = groups["dp"]
    n, r = dist.get_world_size(dp), dist.get_group_rank(dp, dist.get_rank())
    xs, ys = x.chunk(n)[r].chunk(micro_batches), y.chunk(n)[r].chunk(micro_batches)

    def forward(h):
        for w in kit.blocks:
            h = h + kit.tp_mlp(h, *w, group=groups["tp"])
        return h

    def loss(out, target):  # a micro-batch's share of the global batch's mean
        return F.mse_loss(out, target) / (micro_batches * n)

    total = kit.pipeline(forward, list(zip(xs, ys)), loss, groups["pp"])
    for t in kit.params():
        comm.all_reduce(t.grad, group=dp)
    comm.all_reduce(total, group=dp)
    return total


class Recompute(torch.autograd.Function):
    """forward(h) run without keeping its activations; run again, with them, in the backward."""
    @staticmethod
    def forward(ctx, forward, h):
        ctx.forward = forward
        ctx.save_for_backward(h)
        with torch.no_grad():
            return forward(h)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        with torch.enable_grad():
            h = h.detach().requires_grad_()
            torch.autograd.backward(ctx.forward(h), grad)
        return None, h.grad


def checkpointed(forward):
    """A function like ``forward`` that keeps only its input for the backward, and recomputes the rest there."""
    return lambda h: Recompute.apply(forward, h)


def memory_per_gpu(model, layout):
    """Bytes a GPU holds at most in a step of ``layout``: {"states": weights, gradients and Adam's state of
    its shard, "activations": what its pipeline stage keeps for the backward at most}."""
    psi = model.stage_params(layout.pp) / layout.tp     # this GPU's parameters
    states = (2 + 2) * psi + 12 * psi / (layout.dp * layout.cp)  # BF16 weights and gradients; FP32 master and
                                                                 # Adam's two moments sharded over the data ranks
    s, b, h = layout.seq, layout.micro_batch_size, model.hidden
    per_layer = (2 if layout.recompute else 34) * s * b * h / (layout.tp * layout.cp)
    in_flight = min(layout.pp, layout.micro_batches)            # 1F1B's first stage
    return {"states": states, "activations": in_flight * math.ceil(model.layers / layout.pp) * per_layer}
