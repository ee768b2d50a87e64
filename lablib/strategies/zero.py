"""Data parallelism and ZeRO stages 1 and 2 (Rajbhandari et al. 2019, https://arxiv.org/abs/1910.02054):
every rank computes the whole model's forward and backward on its own micro-batch; they differ in
what a rank keeps of the gradient and the optimizer state, and so in the collectives of a step.

    DP      all-reduce the gradient, update everything          keeps 16Ψ bytes (mixed-precision Adam)
    ZeRO-1  all-reduce, update my shard, all-gather parameters   4Ψ + 12Ψ/N
    ZeRO-2  reduce-scatter, update my shard, all-gather          2Ψ + 14Ψ/N

ZeRO-3 (the parameters sharded too) is in fsdp.py. A stage runs a ``step`` function per unit: a
learner's (``ZeRO1(step=my_zero1_step)``), or lablib's answer (``lablib.answers.lab01.STAGES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .. import comm
from ..memory import STAGE_NAMES
from ..timeline import span
from ..toy import loss_fn
from .flat import Unit, flat_grad


def dp_step(unit: Unit, ctx) -> None:
    """Replicated data parallelism: every rank averages the full gradient and updates everything."""
    comm.all_reduce(unit.grad, name="all_reduce grads")  # sum over ranks...
    unit.grad /= ctx.world_size                           # ...so divide for the mean
    ctx.update(unit, unit.grad)


@dataclass(frozen=True)
class _WholeModel:
    """Forward and backward on the whole (replicated) model, then ``step`` per unit."""
    step: Callable
    sharded = True
    frees_params = False
    name = ""

    @property
    def title(self) -> str:
        return STAGE_NAMES[self.name]

    def train_step(self, units, x, y, ctx):
        with span("fwd+bwd"):
            loss = loss_fn(nn.Sequential(*[u.module for u in units])(x), y)
            loss.backward()
        for u in units:
            u.grad = flat_grad(u)
            self.step(u, ctx)
        return loss


@dataclass(frozen=True)
class DP(_WholeModel):
    step: Callable = dp_step
    sharded = False
    name = "dp"


@dataclass(frozen=True)
class ZeRO1(_WholeModel):
    name = "zero1"


@dataclass(frozen=True)
class ZeRO2(_WholeModel):
    name = "zero2"
