"""Lab 02 (collectives): Tasks 2.1-2.4, the learner's rings against torch.distributed's own collectives
on 2, 3 and 4 ranks, several dtypes and sizes, sending exactly the ring's messages."""
from __future__ import annotations

import torch

from ..comm import ring_steps
from ..pool import Cluster
from . import CheckFailed, passed, pools, run_on_ranks

_RING_CASES = [(torch.float32, 1), (torch.float32, 7), (torch.float64, 1000), (torch.int64, 5), (torch.bfloat16, 64)]
_TORCH_NAME = {"all_gather": "dist.all_gather_into_tensor", "reduce_scatter": "dist.reduce_scatter_tensor",
               "all_reduce": "dist.all_reduce"}


def ring_job(fn, op: str) -> list:
    """On each rank: the learner's ring and torch's collective on the same inputs, for every case."""
    import torch.distributed as dist

    from ..comm import all_gather_single, reduce_scatter_single
    from ..timeline import RECORDER

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype, chunk in _RING_CASES:
        g = torch.Generator().manual_seed(100 * rank + chunk)
        numel = chunk * n - (1 if op == "all_reduce" and n > 1 else 0)  # all-reduce: a size n does not divide
        x = (torch.randn(numel if op != "all_gather" else chunk, generator=g) * 8).to(dtype)
        before = len(RECORDER.spans)
        if op == "all_gather":
            got, want = torch.zeros(chunk * n, dtype=dtype), torch.empty(chunk * n, dtype=dtype)
            fn(got, x.clone())
            all_gather_single(want, x.clone())
        elif op == "reduce_scatter":
            got, want = torch.zeros(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
            fn(got, x.clone())
            reduce_scatter_single(want, x.clone())
        else:
            got, want = x.clone(), x.clone()
            fn(got)
            dist.all_reduce(want)
        comm_ops = [s.meta.get("op") for s in RECORDER.spans[before:] if s.kind == "comm"]
        sends = comm_ops.count("send")
        collectives = set(comm_ops) & set(_TORCH_NAME)
        out.append((str(dtype).replace("torch.", ""), chunk, got, want, sends, sorted(collectives)))
    return out



def judge_ring(task: str, op: str, n: int, per_rank: list, fn_name: str) -> None:
    """Raises CheckFailed at the first case where a rank's result or message count is wrong."""
    steps = ring_steps(op, n)
    for rank, cases in enumerate(per_rank):
        for dtype, chunk, got, want, sends, collectives in cases:
            where = f"{fn_name} on {n} ranks, {dtype}, chunks of {chunk}"
            if collectives:
                raise CheckFailed(f"{task}: {where}: rank {rank} called {', '.join(collectives)}. Build the ring "
                                  "from point-to-point messages only (lablib.send/recv/isend/irecv).")
            if sends != steps:
                raise CheckFailed(
                    f"{task}: {where}: rank {rank} sent {sends} message(s) through lablib's send/isend, the ring "
                    f"sends {steps} ({'2 x ' if op == 'all_reduce' else ''}N-1 steps, one message each). "
                    "Use lablib.send/recv/isend/irecv (so the timeline can show the ring), one send per step.")
            if got.shape != want.shape:
                raise CheckFailed(f"{task}: {where}: rank {rank}'s output has shape {tuple(got.shape)}, "
                                  f"expected {tuple(want.shape)}")
            tol = 0 if not want.is_floating_point() else \
                (64 if want.dtype == torch.bfloat16 else 4) * torch.finfo(want.dtype).eps * n * 8 * 4
            diff = (got.double() - want.double()).abs()
            if diff.max().item() > tol:
                bad = sorted({int(i) // max(chunk, 1) for i in (diff > tol).nonzero().flatten().tolist()})
                raise CheckFailed(
                    f"{task}: {where}: rank {rank}'s result differs from {_TORCH_NAME[op]}'s "
                    f"(by up to {diff.max().item():.3g}) in chunk(s) {bad[:6]}. {_RING_OP_HINTS[op]}")


def _check_ring(task: str, fn, op: str, cluster: Cluster) -> None:
    __tracebackhide__ = True
    sizes = []
    with pools(cluster) as ranks:
        for pool in ranks:
            per_rank = run_on_ranks(pool, task, ring_job, fn, op, hints=_RING_HINTS)
            judge_ring(task, op, pool.world_size, per_rank, getattr(fn, "__name__", "your function"))
            sizes.append(pool.world_size)
    passed(task, f": {op.replace('_', '-')} matches {_TORCH_NAME[op]} on {', '.join(map(str, sizes))} ranks for "
                 f"{len(_RING_CASES)} dtype/size cases, with {'2(N-1)' if op == 'all_reduce' else 'N-1'} messages "
                 "per rank")


def check_ring_blocking(fn, cluster: Cluster) -> None:
    """Task 2.1: ring all-gather with blocking send and recv."""
    __tracebackhide__ = True
    _check_ring("Task 2.1", fn, "all_gather", cluster)


def check_ring_all_gather(fn, cluster: Cluster) -> None:
    """Task 2.2: ring all-gather with isend and irecv."""
    __tracebackhide__ = True
    _check_ring("Task 2.2", fn, "all_gather", cluster)


def check_ring_reduce_scatter(fn, cluster: Cluster) -> None:
    """Task 2.3: ring reduce-scatter."""
    __tracebackhide__ = True
    _check_ring("Task 2.3", fn, "reduce_scatter", cluster)


def check_ring_all_reduce(fn, cluster: Cluster) -> None:
    """Task 2.4: ring all-reduce (pad, reduce-scatter, all-gather, unpad)."""
    __tracebackhide__ = True
    _check_ring("Task 2.4", fn, "all_reduce", cluster)


_DEADLOCK = "a deadlock: ranks are blocked in send or recv, waiting for each other (see the Hint below)."
_RING_HINTS = (("in send", _DEADLOCK), ("in recv", _DEADLOCK))
_RING_OP_HINTS = {
    "all_gather": "At step s rank r sends chunk (r - s) mod N to rank r+1 and receives chunk (r - s - 1) mod N "
                  "from rank r-1: the chunk it received at the step before. Did you copy your own input into "
                  "chunk r of the output first?",
    "reduce_scatter": "At step s rank r sends its partial sum of chunk (r - s - 1) mod N and adds the chunk "
                      "(r - s - 2) mod N it receives to its own partial sum; after N-1 steps it holds the full sum "
                      "of chunk r. Did you add what you received, and write chunk r to the output at the end?",
    "all_reduce": "Pad the tensor to a multiple of N, reduce-scatter it into your chunk, all-gather the chunks "
                  "back into the padded buffer, then copy the unpadded part back into the tensor (in place).",
}
