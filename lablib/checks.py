"""Exercise checks: run the learner's function on real ranks, compare with a reference, and say what
differed and the likely cause. A failed check raises ``CheckFailed`` (an AssertionError), so the check
cell fails under nbval and in ``lablib grade``."""
from __future__ import annotations

import torch

from .cluster import Cluster, RankError


class CheckFailed(AssertionError):
    pass


def run_on_ranks(cluster: Cluster, task: str, learner_fn, job, *args):
    """``cluster.run(job, *args)``, turning "not done yet" and rank errors into teaching messages.

    ``learner_fn`` is the learner's function that ``job`` calls, named in the messages."""
    __tracebackhide__ = True  # IPython shows the message, not this file's frames
    name = getattr(learner_fn, "__name__", "your function")
    try:
        return cluster.run(job, *args)
    except RankError as err:
        first = err.ranks[0] if err.ranks else 0
        exc = err.exception(first)
        if isinstance(exc, NotImplementedError):
            raise CheckFailed(f"{task} is not done yet: {name} still raises NotImplementedError. "
                              "Replace the `raise` line with your code.") from None
        raise CheckFailed(f"{task}: your function failed on the ranks.\n\n{err}") from None


def _mean_inputs(world_size):
    return [torch.arange(4, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]


def _mean_job(fn):
    import torch.distributed as dist

    return fn(_mean_inputs(dist.get_world_size())[dist.get_rank()].clone())


def check_mean_across_ranks(fn, cluster: Cluster) -> None:
    """Task 0.1: every rank must return the element-wise mean of all ranks' tensors."""
    __tracebackhide__ = True
    task = "Task 0.1"
    n = cluster.world_size
    results = run_on_ranks(cluster, task, fn, _mean_job, fn)
    inputs = _mean_inputs(n)
    expected = torch.stack(inputs).mean(0)  # the single-process reference
    for rank, out in enumerate(results):
        if out is None:
            raise CheckFailed(f"{task}: rank {rank} returned None. Return the averaged tensor.")
        if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
            raise CheckFailed(f"{task}: rank {rank} returned {type(out).__name__} "
                              f"{getattr(out, 'shape', '')}, expected a tensor of shape {tuple(expected.shape)}.")
        if torch.allclose(out, expected * n):
            raise CheckFailed(f"{task}: rank {rank} holds the sum over ranks, {out.tolist()}, not the mean "
                              f"{expected.tolist()}. Did you divide by the world size after the all-reduce?")
        if torch.allclose(out, inputs[rank]) or torch.allclose(out, inputs[rank] / n):
            raise CheckFailed(f"{task}: rank {rank} returned only its own data, {out.tolist()}. "
                              "Did the all-reduce run, on the tensor you return?")
        if not torch.allclose(out, expected, atol=1e-6):
            raise CheckFailed(f"{task}: rank {rank} returned {out.tolist()}, expected {expected.tolist()}.")
    error = max((out - expected).abs().max().item() for out in results)
    print(f"✓ {task} passed on {n} ranks: every rank holds the mean; max error vs the single-process "
          f"reference {error:.1e}")
