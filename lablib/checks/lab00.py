"""Lab 00 (welcome): Task 0.1, the mean over ranks."""
from __future__ import annotations

import torch

from ..pool import PerRank
from ..toy import generator
from . import Check, CheckFailed, run_on_ranks

TASK = "Task 0.1"


def inputs(world_size: int, seed: int | None = None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.arange(4, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]
    g = generator(seed)
    numel = 3 + seed % 7
    return [torch.randn(numel, generator=g) * 10 for _ in range(world_size)]


def mean_job(fn, x):
    """On each rank: the learner's function on this rank's input (its share: no rank gets another's, or the seed)."""
    from ..comm import to_device

    return fn(to_device(x).clone())


def collect_mean(fns, pool, seed):
    return run_on_ranks(pool, TASK, mean_job, fns[0], PerRank(inputs(pool.world_size, seed)))


def judge_mean(results: list, world_size: int, seed: int | None = None) -> str:
    ins = inputs(world_size, seed)
    expected = torch.stack(ins).mean(0)  # the single-process reference
    if not isinstance(results, list) or len(results) != world_size:
        raise CheckFailed(f"{TASK}: expected one result per rank from {world_size} ranks.")
    for rank, out in enumerate(results):
        if out is None:
            raise CheckFailed(f"{TASK}: rank {rank} returned None. Return the averaged tensor.")
        if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
            raise CheckFailed(f"{TASK}: rank {rank} returned {type(out).__name__} "
                              f"{getattr(out, 'shape', '')}, expected a tensor of shape {tuple(expected.shape)}.")
        if torch.allclose(out, expected * world_size):
            raise CheckFailed(f"{TASK}: rank {rank} holds the sum over ranks, {out.tolist()}, not the mean "
                              f"{expected.tolist()}. Did you divide by the world size after the all-reduce?")
        if torch.allclose(out, ins[rank]) or torch.allclose(out, ins[rank] / world_size):
            raise CheckFailed(f"{TASK}: rank {rank} returned only its own data, {out.tolist()}. "
                              "Did the all-reduce run, on the tensor you return?")
        if not torch.allclose(out, expected, atol=1e-5):
            raise CheckFailed(f"{TASK}: rank {rank} returned {out.tolist()}, expected {expected.tolist()}.")
    error = max((out - expected).abs().max().item() for out in results)
    return (f" on {world_size} ranks: every rank holds the mean; max error vs the single-process reference "
            f"{error:.1e}")


check_mean_across_ranks = Check(TASK, ("mean_across_ranks",), collect_mean, judge_mean, world_sizes=(4,))
"""Task 0.1: every rank must return the element-wise mean of all ranks' tensors."""
