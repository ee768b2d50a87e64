"""The training harness every strategy runs in: the optimizer, a rank's context, ``train`` (on the
ranks, with a strategy object) and ``reference`` (one process, the whole batch: what every strategy
must reproduce).

A strategy is an object with ``name``, ``title``, ``sharded``, ``frees_params`` and
``train_step(units, x, y, ctx) -> loss``; each lives in a file of its own (zero.py, fsdp.py, ...), and
the harness knows none of them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from ..comm import to_device
from ..memory import held_bytes
from ..toy import batch, build_model, loss_fn
from .flat import Unit, flat_grad, setup


@dataclass(frozen=True)
class Optimizer:
    """Element-wise, so updating a shard gives exactly the slice of updating the whole."""
    name: str = "sgd"        # "sgd" (with momentum) or "adam"
    lr: float = 0.05
    momentum: float = 0.9
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8

    def init_state(self, master: torch.Tensor) -> dict:
        if self.name == "sgd":
            return {"momentum": torch.zeros_like(master)}
        return {"exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master), "step": 0}

    def update(self, master: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        grad = grad.float()
        if self.name == "sgd":  # torch.optim.SGD, dampening 0: buf = m*buf + g; p -= lr*buf
            buf = state["momentum"]
            buf.mul_(self.momentum).add_(grad)
            master.add_(buf, alpha=-self.lr)
            return
        b1, b2 = self.betas  # torch.optim.Adam
        state["step"] += 1
        state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (state["exp_avg_sq"] / (1 - b2 ** state["step"])).sqrt_().add_(self.eps)
        master.addcdiv_(state["exp_avg"], denom, value=-self.lr / (1 - b1 ** state["step"]))


@dataclass(frozen=True)
class Context:
    """What a strategy's step needs besides the unit: who we are, and the optimizer."""
    rank: int
    world_size: int
    optimizer: Optimizer
    depth: int = 0  # lab 03: how many units ahead to prefetch

    def update(self, unit: Unit, grad: torch.Tensor) -> None:
        """Optimizer step on ``unit.master`` with ``grad`` (same size); refresh ``unit.shard`` from it."""
        if grad.numel() != unit.master.numel():
            raise ValueError(f"ctx.update got a gradient of {grad.numel()} elements, but this rank updates "
                             f"{unit.master.numel()} values (its shard): pass the part of the gradient that "
                             f"matches this rank's shard, unit.grad[start:end] with start, end = "
                             f"unit.layout.shard_bounds(ctx.rank)")
        self.optimizer.update(unit.master, grad, unit.state)
        if unit.master.data_ptr() != unit.shard.data_ptr():  # mixed precision: fp32 master -> bf16 shard
            unit.shard.copy_(unit.master)


def rank_data(model_name: str, steps: int, rank: int, seed: int = 0) -> tuple:
    """(the initial model, rank ``rank``'s batches of ``steps`` steps): what a rank trains on, which a check hands
    each rank as its own share (``lablib.pool.PerRank``) rather than the seed it is drawn from."""
    return build_model(model_name, seed), [batch(model_name, step, rank, seed) for step in range(steps)]


def shares(models, steps: int, n: int, seed=None):
    """``rank_data`` of each of ``n`` ranks, per model in ``models``, as a ``PerRank``: a check's rank job gets its
    rank's share, never the seed."""
    from ..pool import PerRank

    return PerRank([{m: rank_data(m, steps, rank, seed or 0) for m in models} for rank in range(n)])


def train(strategy, model_name: str = "mlp", steps: int = 3, optimizer: Optimizer = Optimizer(),
          mixed: bool = False, seed: int = 0, data: tuple | None = None) -> dict:
    """Train on this rank (inside ``cluster.run``) with ``strategy``; every rank sees its own batches.

    ``seed`` draws other initial weights and batches (hidden checks); ``data``: this rank's ``rank_data``,
    given instead. Returns the full fp32 parameters
    per unit (gathered, unpadded), the bytes held by kind after the last step, the losses and Ψ (the
    padded parameter count)."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    ctx = Context(rank, n, optimizer)
    model, batches = copy.deepcopy(data) if data else rank_data(model_name, steps, rank, seed)
    units = setup(to_device(model), rank, n, optimizer.init_state, strategy.sharded, strategy.frees_params,
                  torch.bfloat16 if mixed else torch.float32)
    # Start the steps together (untraced): otherwise the first collective absorbs the ranks' uneven
    # set-up time and looks like slow communication on the timeline.
    dist.barrier()
    losses = []
    for step in range(steps):
        x, y = to_device(*batches[step])
        if mixed:
            x = x.to(torch.bfloat16)
        losses.append(strategy.train_step(units, x, y, ctx).item())
    memory = held_bytes(units)
    return {"params": gather_full(units, strategy.sharded), "memory": memory, "losses": losses,
            "psi": sum(u.layout.padded_numel for u in units)}


def gather_full(units: list[Unit], sharded: bool) -> list[torch.Tensor]:
    """Every unit's full fp32 parameters (unpadded), whatever the strategy kept: for checking only, so
    the gather is not traced (it is no part of a training step)."""
    out = []
    for u in units:
        full = u.master
        if sharded:
            full = torch.empty(u.layout.padded_numel, dtype=u.master.dtype, device=u.master.device)
            comm.all_gather_single(full, u.master.contiguous())
        out.append(full[:u.layout.numel].float().clone())
    return out


def reference(model_name: str = "mlp", steps: int = 3, world_size: int = 2,
              optimizer: Optimizer = Optimizer(), seed: int = 0) -> list[torch.Tensor]:
    """One process, the whole batch (every rank's micro-batch), the same optimizer: what every strategy
    must reproduce. Returns the full fp32 parameters per unit, flattened."""
    units = setup(build_model(model_name, seed), 0, 1, optimizer.init_state, sharded=False)
    model = nn.Sequential(*[u.module for u in units])
    for step in range(steps):
        xs, ys = zip(*(batch(model_name, step, r, seed) for r in range(world_size)))
        loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
        for u in units:
            optimizer.update(u.master, flat_grad(u), u.state)
    return [u.master[:u.layout.numel].clone() for u in units]
