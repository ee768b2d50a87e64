"""fp16 loss scaling that every rank agrees on (Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740;
``torch.amp.GradScaler``, and FSDP's ``ShardedGradScaler``, which all-reduces its found-inf flag).

fp16 holds numbers up to 65,504 and loses gradients below about 6e-8 (6e-5 with full precision). The loss
is multiplied by a scale before the backward, so small gradients survive; the gradients are divided by it
before the step. A scale too large makes some gradient inf: that step is skipped and the scale halved;
after ``growth_interval`` good steps in a row it doubles. With sharded gradients each rank sees only its
shard, so an inf shows on one rank only: the decision must be reduced across ranks, or the ranks that
stepped and the rank that skipped hold shards of different models from then on.

``job`` runs a learner's ``scaled_update(grad, scaler, step)`` on the ranks, over steps whose true gradients
are given (the fp16 gradient is made from them and the scaler's scale, so a wrong scale shows in what
overflows next); ``reference`` is the same in one process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import comm
from ..toy import generator

FP16_MAX = torch.finfo(torch.float16).max
LR = 0.1


@dataclass
class Scaler:
    """The scaler's state and settings, as ``torch.amp.GradScaler`` has them."""
    scale: float = 2.0 ** 16
    good: int = 0                 # good steps in a row since the scale last changed (GradScaler's growth tracker)
    growth_interval: int = 3
    backoff: float = 0.5
    growth: float = 2.0


def cases(world_size: int, seed: int = 0, steps: int = 12) -> dict:
    """Every rank's fp32 master shard and its true gradient shard at each step: small gradients, and spikes that
    overflow fp16 once scaled, on one rank at a time. Which ranks and which steps are drawn from ``seed`` (a rank
    cannot know another's): two overflows in a row early, then a NaN after a run of good steps long enough for
    the scale to grow."""
    g = generator(29 + seed)
    numel = 6
    masters = [torch.randn(numel, generator=g) for _ in range(world_size)]
    grads = [[torch.randn(numel, generator=g) * 1e-2 for _ in range(world_size)] for _ in range(steps)]
    first = 1 + int(torch.randint(3, (1,), generator=g))
    last = first + 5 + int(torch.randint(steps - first - 6, (1,), generator=g))
    first_rank = 1 + int(torch.randint(world_size - 1, (1,), generator=g))  # never rank 0 alone: its flag is no
    other = (first_rank + 1 + int(torch.randint(world_size - 1, (1,), generator=g))) % world_size  # broadcast
    picks = [first_rank, other, int(torch.randint(world_size, (1,), generator=g))]
    spikes = {first: (picks[0], 2.0), first + 1: (picks[1], 3.0), last: (picks[2], math.nan)}
    for k, (r, value) in spikes.items():
        grads[k][r][int(torch.randint(numel, (1,), generator=g))] = value
    return {"masters": masters, "grads": grads, "spikes": {k: r for k, (r, _) in spikes.items()}}


def scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """The fp16 gradient of (loss × scale) whose true gradient is ``grad``: inf where it overflows."""
    return (grad.double() * scale).to(torch.float16)


def job(fn, share) -> dict:
    """On the ranks: ``fn(grad, scaler, step)`` at each step, ``share`` this rank's (master, grads per step)."""
    master, grads = share
    master = comm.to_device(master.clone())
    scaler, log, called = Scaler(), [], []

    def step(grad):
        if not isinstance(grad, torch.Tensor) or grad.shape != master.shape:
            raise ValueError(f"step takes this rank's unscaled gradient shard, a tensor of {master.numel()} numbers; "
                             f"got {type(grad).__name__}{tuple(grad.shape) if isinstance(grad, torch.Tensor) else ''}")
        called.append(grad.detach().float().cpu().clone())
        master.sub_(LR * grad.float())

    ops = []
    for grad in grads:
        called.clear()
        before = scaler.scale
        out, sent = comm.watched(fn, comm.to_device(scaled(grad, before)), scaler, step)
        ops.append(sent)
        log.append({"returned": out, "stepped": len(called), "grad": called[0] if called else None,
                    "scale": float(scaler.scale), "good": int(scaler.good)})
    return {"log": log, "master": master.cpu(), "ops": ops}


def reference(masters, grads) -> dict:
    """Every rank's master shard and the scaler's trajectory, in one process: a step is skipped on every rank
    when any rank's scaled gradient overflowed."""
    masters, scaler, log = [m.clone() for m in masters], Scaler(), []
    for per_rank in grads:
        found = any(not torch.isfinite(scaled(g, scaler.scale)).all() for g in per_rank)
        if found:
            scaler.scale *= scaler.backoff
            scaler.good = 0
        else:
            for m, g in zip(masters, per_rank):
                m.sub_(LR * (scaled(g, scaler.scale).float() / scaler.scale))
            scaler.good += 1
            if scaler.good == scaler.growth_interval:
                scaler.scale *= scaler.growth
                scaler.good = 0
        log.append({"stepped": not found, "scale": scaler.scale, "good": scaler.good})
    return {"masters": masters, "log": log}
