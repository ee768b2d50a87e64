"""ZeRO-3 / FSDP: each rank keeps only its shard of the parameters; a unit's full parameters exist
only while that unit computes (ZeRO, Rajbhandari et al. 2019; PyTorch FSDP, Zhao et al. 2023,
https://arxiv.org/abs/2304.11277).

Per step and unit: all-gather before the forward, free after it; all-gather again before the backward,
free after it; reduce-scatter the gradient so each rank keeps its shard. That is 3 collectives of the
unit's size where replicated DP needs one all-reduce (= 2): FSDP sends 1.5x the bytes of DP.

This file's backward recomputes each unit's forward from its saved input, so the order of the
collectives is plain to read. PyTorch's FSDP instead keeps the activations and re-gathers parameters
in autograd hooks; it sends the same bytes. ``fsdp2_train`` runs PyTorch's FSDP2 (``fully_shard``) on
the same model and batches, for comparison.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass
from typing import Callable

from .. import comm
from ..memory import STAGE_NAMES, storage_bytes
from ..timeline import span
from ..toy import batch, build_model, loss_fn
from .flat import FlatLayout, Unit, flat_grad
from .harness import Optimizer


def reduce_mean(unit: Unit, full, ctx) -> None:
    """``unit.grad``: this rank's shard of the gradient ``full``, averaged over the ranks."""
    unit.grad = torch.empty(unit.layout.shard_numel, dtype=full.dtype, device=full.device)
    comm.reduce_scatter(unit.grad, full, name="reduce_scatter grads")
    unit.grad /= ctx.world_size


def forward_backward(units: list[Unit], x, y, ctx, unshard: Callable, reshard: Callable, reduce: Callable = reduce_mean):
    """One ZeRO-3 forward and backward; ``reduce(unit, full_gradient, ctx)`` leaves each unit's gradient shard in
    ``unit.grad``. The units compute in their parameters' dtype, ``x``'s."""
    inputs, h = [], x
    with torch.no_grad():
        for i, u in enumerate(units):
            inputs.append(h)
            unshard(u, ctx)
            with span(f"fwd unit {i}"):
                h = u.module(h)
            reshard(u)
    with span("loss"):
        h = h.detach().requires_grad_(True)
        loss = loss_fn(h, y)
        loss.backward()
        grad = h.grad
    for i in reversed(range(len(units))):
        u = units[i]
        unshard(u, ctx)
        with span(f"bwd unit {i}"):
            inp = inputs[i].detach().requires_grad_(inputs[i].is_floating_point())
            out = u.module(inp)  # recompute the forward, this time recording the graph
            out.backward(grad)
            grad = inp.grad
        u.grad = None
        reduce(u, flat_grad(u), ctx)
        reshard(u)
    return loss


@dataclass(frozen=True)
class ZeRO3:
    """ZeRO-3 / FSDP: only the shard persists; ``unshard(unit, ctx)`` makes a unit's parameters whole,
    ``reshard(unit)`` frees them (a learner's, or ``lablib.answers.lab01``'s)."""
    unshard: Callable
    reshard: Callable
    name = "zero3"
    sharded = True
    frees_params = True

    @property
    def title(self) -> str:
        return STAGE_NAMES[self.name]

    def train_step(self, units, x, y, ctx):
        loss = forward_backward(units, x, y, ctx, self.unshard, self.reshard)
        for u in units:
            ctx.update(u, u.grad)
        return loss


def sum_then_divide_on_gloo(model) -> None:
    """On Gloo, make FSDP2 reduce-scatter gradients with SUM and divide by the world size itself.

    FSDP2 asks for ``ReduceOp.AVG``, and torch 2.8's Gloo sums instead (it averages in 2.13 and 2.15),
    so FSDP2 trained on gradients world-size times too large there. SUM is right on every release."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule) and hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)


def fsdp2_train(model_name: str = "mlp", steps: int = 3, optimizer: Optimizer = Optimizer()) -> dict:
    """PyTorch's FSDP2 on the same model, initial weights and batches (run inside ``cluster.run``).

    Returns each parameter's local shard (as FSDP2 holds it: dim 0 split with ``torch.chunk``), its
    full value, and the bytes this rank holds for parameters, gradients and optimizer state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if optimizer.name != "sgd":
        raise ValueError("compare with SGD: Adam amplifies rounding differences into visible ones")
    rank = dist.get_rank()
    dev = comm.torch_device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    model = build_model(model_name).to(dev)
    for unit in model:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_then_divide_on_gloo(model)
    opt = torch.optim.SGD(model.parameters(), lr=optimizer.lr, momentum=optimizer.momentum)
    for step in range(steps):
        opt.zero_grad()  # here, not after step(): the last step's gradients stay to be measured
        x, y = (v.to(dev) for v in batch(model_name, step, rank))
        loss_fn(model(x), y).backward()
        opt.step()
    held = storage_bytes(pair for p in model.parameters() for pair in
                         [("params", p), ("grads", p.grad)] + [("optimizer", t) for t in opt.state[p].values()])
    params = [(name, p.to_local().detach().clone(), p.full_tensor().detach().clone())
              for name, p in model.named_parameters()]
    return {"params": params, "memory": held}


def unflatten(model_name: str, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our per-unit flat parameters as {parameter name: tensor}, named as in the model."""
    out = {}
    for (i, unit), flat in zip(enumerate(build_model(model_name)), flats):
        names, params = zip(*unit.named_parameters())
        out.update((f"{i}.{name}", view) for name, view in zip(names, FlatLayout.of(params, 1).views(flat)))
    return out

