"""Steps that hang, for lab 10's flight-recorder analysis: each rank's record of its collectives
(``lablib.flight``) is what is left to find where the ranks parted.

Each case is a real pattern (the rank it shows on drawn from the seed, never rank 0):
- "skipped": a data-dependent branch; after a few good steps, the rank whose loss is not finite skips the
  gradients' all-reduce, then joins the loss's, which the others meet with their gradient's.
- "reordered": the rank all-reduces its gradients last layer first (hooks fired in another order).
- "shape": the rank pads its shard to another size (ceil where the others floor) before an all-gather.
- hidden, "one fewer": after a long run (more collectives than a recorder keeps), the rank's data ran out one
  step early, so every other rank waits in a collective it never joins; and "dtype": the rank all-reduces its
  gradient in bf16, as many bytes as the others' fp32 but not the same collective.

Gloo may wait until the pool's timeout, abort the rank that receives more than it expects, or (same bytes)
go on with wrong numbers: ``flights`` returns each rank's record whichever happens.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .. import comm, flight
from ..pool import RankError
from ..toy import generator

CASES = ("skipped", "reordered", "shape")
HIDDEN = ("one fewer", "dtype")
LONG = 40  # steps of "one fewer": more collectives than a rank's flight recorder keeps (flight.SIZE)
SIZES = (24, 40, 8)  # the step's gradients, per layer
GOOD_STEPS = 3  # "skipped": steps before the one whose loss is not finite on the odd rank


def odd_rank(seed: int, world_size: int) -> int:
    return 1 + int(torch.randint(max(world_size - 1, 1), (1,), generator=generator(17 + seed)))


def step(case: str, seed: int = 0, group=None) -> tuple:
    """On a rank: one hanging (or wrong) step; its flight recorder's entries if it finishes."""
    r, n = dist.get_rank(), dist.get_world_size()
    all_reduce, all_gather = partial(comm.all_reduce, group=group), partial(comm.all_gather, group=group)
    odd = r == odd_rank(seed, n)
    dev = comm.device()
    grads = [torch.full((k,), float(r), device=dev) for k in SIZES]
    all_reduce(torch.ones(1, device=dev), name="all_reduce start")
    if case == "skipped":
        for k in range(GOOD_STEPS + 1):  # the odd rank's loss is not finite at the last step
            loss = torch.tensor([float("nan") if odd and k == GOOD_STEPS else 1.0], device=dev)
            if torch.isfinite(loss).all():
                for g in grads:
                    all_reduce(g, name="all_reduce grads")
            all_reduce(loss, name="all_reduce loss")
    elif case == "reordered":
        for g in reversed(grads) if odd else grads:
            all_reduce(g, name="all_reduce grads")
    elif case == "shape":
        total = sum(SIZES) + 1  # not a multiple of the ranks: each rank pads its shard
        shard = -(-total // n) if not odd else total // n + (1 if total % n else 0) + 1
        out = torch.empty(shard * n, device=dev)
        all_gather(out, torch.zeros(shard, device=dev), name="all_gather params")
    elif case == "one fewer":
        for _ in range(LONG - 1 if odd else LONG):
            all_reduce(grads[0], name="all_reduce grads")
        if odd:
            return flight.entries()  # its data ran out: it leaves the loop and the job
    elif case == "dtype":
        g = grads[0].to(torch.bfloat16).repeat(2) if odd else grads[0]
        all_reduce(g, name="all_reduce grads")
    else:
        raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES + HIDDEN)}")
    all_reduce(torch.ones(1, device=dev), name="all_reduce end")
    return flight.entries()


def flights(pool, case: str, seed: int = 0) -> dict:
    """{rank: its flight recorder's entries} after ``case``'s step on ``pool``'s ranks, whether it hung, a rank
    was aborted or it finished (a pool with a short timeout keeps the wait short)."""
    try:
        return dict(enumerate(pool.run(step, case, seed)))
    except RankError as err:
        return {r: err.flight(r) for r in range(pool.world_size)}


def pytorch_record(case: str, seed: int = 0, timeout_s: float = 2.0) -> tuple:
    """On a rank: ``case``'s step on a new group with PyTorch's own Flight Recorder on (``TORCH_FR_BUFFER_SIZE``;
    on Gloo it records each collective as scheduled, without durations) and a short timeout, so a rank that
    waits raises and reads it. Returns (lablib's entries, PyTorch's as [(op, input shape)] on that group)."""
    import os
    import pickle
    from datetime import timedelta

    def dump() -> list:
        return pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("entries", [])

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    before = max((e["record_id"] for e in dump()), default=-1)  # its buffer outlives jobs and groups' names
    dist.barrier()  # every rank here (one restarted after a failure starts late) before the short timeout runs
    flight.started()
    try:
        step(case, seed, group)
    except RuntimeError:
        pass  # this rank waited past the group's timeout: what the recorders hold is the point
    theirs = [(e["profiling_name"].split(":")[-1], tuple(e["input_sizes"][0]) if e["input_sizes"] else ())
              for e in dump() if e["record_id"] > before and e["process_group"][0] == group.group_name
              and e["profiling_name"] != "gloo:barrier"]
    dist.destroy_process_group(group)  # its threads and sockets
    return flight.entries(), theirs
