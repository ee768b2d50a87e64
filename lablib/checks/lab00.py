"""Lab 00 (welcome): Task 0.1, the mean over ranks."""
from __future__ import annotations

import torch

from ..pool import Cluster
from . import CheckFailed, passed, run_on_ranks

TASK = "Task 0.1"


def inputs(world_size: int) -> list[torch.Tensor]:
    return [torch.arange(4, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]


def mean_job(fn):
    """On each rank: the learner's function on this rank's input."""
    import torch.distributed as dist

    return fn(inputs(dist.get_world_size())[dist.get_rank()].clone())


def judge_mean(results: list, world_size: int) -> str:
    ins = inputs(world_size)
    expected = torch.stack(ins).mean(0)  # the single-process reference
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
        if not torch.allclose(out, expected, atol=1e-6):
            raise CheckFailed(f"{TASK}: rank {rank} returned {out.tolist()}, expected {expected.tolist()}.")
    error = max((out - expected).abs().max().item() for out in results)
    return (f" on {world_size} ranks: every rank holds the mean; max error vs the single-process reference "
            f"{error:.1e}")


def check_mean_across_ranks(fn, cluster: Cluster) -> None:
    """Task 0.1: every rank must return the element-wise mean of all ranks' tensors."""
    __tracebackhide__ = True
    passed(TASK, judge_mean(run_on_ranks(cluster, TASK, mean_job, fn), cluster.world_size))
