"""Broken data-parallel steps, each with one of the silent bugs of distributed training, for lab 10's
detectors to find: the replicas of a parameter that drift apart, and gradients off by a factor.

Every step trains lab 01's MLP (``toy``) with plain data parallelism: each rank its own micro-batch, the
gradients all-reduced and averaged, SGD. A case names the bug; the parameter it touches and the rank it shows
on are drawn from the seed, so a detector that names only the notebook's case does not pass another.

Replicas (``replicas``), seen in public as: a model seeded per rank, or initialised on rank 0 and never
broadcast; a gradient left out of the all-reduce (a parameter outside the DDP bucket, or marked
``requires_grad`` after DDP was built); and, hidden, a difference of one ulp (a nondeterministic kernel on
one rank) or two elements swapped (a sum and a norm both miss it).

Gradients (``gradients``): summed, not averaged; the loss scale never taken out; expert gradients not
divided by the expert-parallel size (Megatron-LM pull 5956, PyTorch issue 160285); a gradient not reduced
at all (only this rank's share); and, hidden, the loss's sign flipped, and gradients that hold exact zeros
(a dead ReLU unit), where a ratio taken element by element divides by zero.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..toy import batch, build_model, generator, loss_fn

LR = 0.1
REPLICA_CASES = ("seeded per rank", "initialised on rank 0", "gradient left out")
REPLICA_HIDDEN = ("one ulp", "two swapped", "healthy")
GRADIENT_CASES = ("summed", "loss scale kept", "expert scale", "not reduced")
GRADIENT_HIDDEN = ("sign flipped", "dead units")


def _draws(seed: int, world_size: int, params: int) -> tuple[int, int]:
    """The parameter a case touches and the rank (never 0) it shows on, from the seed."""
    g = generator(101 + seed)
    return int(torch.randint(params, (1,), generator=g)), 1 + int(torch.randint(max(world_size - 1, 1), (1,), generator=g))


def _rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def replicas(case: str, seed: int = 0, steps: int = 2) -> list[tuple[str, torch.Tensor]]:
    """On a rank: the MLP's named parameters after ``steps`` data-parallel steps with ``case``'s bug."""
    r, n = _rank()
    model = comm.to_device(build_model("mlp", seed + (1 + r if case == "seeded per rank" else 0)))
    named = list(model.named_parameters())
    which, odd = _draws(seed, n, len(named))
    target = named[which][1]
    with torch.no_grad():
        if case == "initialised on rank 0" and r == 0:
            target.copy_(torch.randn(target.shape, generator=generator(7 + seed)) * 0.1)
    for step in range(steps):
        x, y = (t.to(target.device) for t in batch("mlp", step, r, seed))
        loss_fn(model(x), y).backward()
        for name, p in named:
            if not (case == "gradient left out" and p is target):
                comm.all_reduce(p.grad, name=f"all_reduce {name}")
                p.grad /= n
        _sgd(model)
    with torch.no_grad():
        flat = target.view(-1)
        if case == "one ulp" and r == odd:
            at = int(flat.abs().argmin())  # the smallest element: its ulp is far below the sum's
            flat[at] = torch.nextafter(flat[at], flat[at] + 1)
        if case == "two swapped" and r == odd:
            i, j = torch.randperm(flat.numel(), generator=generator(13 + seed))[:2].tolist()
            flat[i], flat[j] = flat[j].clone(), flat[i].clone()
    return [(name, p.detach()) for name, p in named]


def apart(params_per_rank: list) -> dict:
    """{"rank r: name": the largest difference of rank r's copy of that parameter from rank 0's}, for r > 0."""
    return {f"rank {r}: {name}": (mine - first).abs().max().item() for r, params in enumerate(params_per_rank[1:], 1)
            for (name, mine), (_, first) in zip(params, params_per_rank[0])}


def differing(params_per_rank: list) -> tuple[str, list[int]] | None:
    """The truth a detector must find, from every rank's parameters: the first parameter whose bits differ
    from rank 0's somewhere, and those ranks; None when every replica is the same to the bit."""
    for i, (name, first) in enumerate(params_per_rank[0]):
        ranks = [r for r, params in enumerate(params_per_rank)
                 if not torch.equal(params[i][1].view(torch.int32), first.view(torch.int32))]
        if ranks:
            return name, ranks
    return None


def checksum_job(diverged, case: str, seed: int = 0) -> dict:
    """A check's job: the learner's ``diverged(named_params)`` on this rank's replica, what it said and the
    collectives it issued (bytes), and the parameters, for the judge to find the truth itself."""
    named = replicas(case, seed)
    said, ops = comm.watched(diverged, [(name, p.clone()) for name, p in named])  # what it changes is not judged
    return {"said": said, "ops": ops, "params": named}


def gradients(case: str, seed: int = 0) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """On a rank: one data-parallel step's gradients with ``case``'s bug, and one process's gradients on the
    whole batch (every rank's micro-batch), both per parameter."""
    r, n = _rank()
    model = comm.to_device(build_model("mlp", seed))
    named = list(model.named_parameters())
    which, _ = _draws(seed, n, len(named))
    if case == "dead units":  # summed, with ReLU units no input switches on: exact zeros in the gradients
        with torch.no_grad():
            named[0][1][:3] = 0.0
            named[1][1][:3] = -1.0
    scale = 2.0 ** (8 + seed % 8) if case == "loss scale kept" else 1.0
    sign = -1.0 if case == "sign flipped" else 1.0
    batches = [tuple(t.to(named[0][1].device) for t in batch("mlp", 0, k, seed)) for k in range(n)]
    (sign * scale * loss_fn(model(batches[r][0]), batches[r][1])).backward()
    got = []
    for name, p in named:
        g = p.grad
        if not (case == "not reduced" and name == named[which][0]):
            comm.all_reduce(g, name=f"all_reduce {name}")
            if case not in ("summed", "dead units"):
                g /= n
        if case == "expert scale" and name == named[which][0]:
            g *= 2  # expert parallelism of 2: each expert's tokens came from 2 ranks, and nothing divided by it
        got.append((name, g.detach().clone()))
    model.zero_grad()
    (sum(loss_fn(model(x), y) for x, y in batches) / n).backward()
    return got, [p.grad.detach().clone() for _, p in named]


def parity_job(factor, case: str, seed: int = 0) -> dict:
    """A check's job: the learner's ``factor(got, want)`` for every parameter of one broken step, with the
    gradients, for the judge."""
    got, want = gradients(case, seed)
    said = [factor(g.clone(), w.clone()) for (_, g), w in zip(got, want)]  # what it changes is not judged
    return {"said": said, "got": got, "want": want}
