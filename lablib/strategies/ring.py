"""Ring collectives from point-to-point messages, and how to measure any collective.

The ring (Patarasuk & Yuan, 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; used by NCCL and Horovod): rank r sends only to r+1 and receives only from r-1, and
the data is cut into N chunks.

- all-gather: N-1 steps; at step s rank r forwards chunk (r - s) and receives chunk (r - s - 1).
- reduce-scatter: N-1 steps; at step s rank r sends its partial sum of chunk (r - s - 1) and adds the
  partial sum of chunk (r - s - 2) it receives; after the last step it holds the full sum of chunk r.
- all-reduce = reduce-scatter + all-gather.

Each rank sends (N-1)/N of the data per all-gather or reduce-scatter, 2(N-1)/N per all-reduce: the
lower bound for any algorithm built from point-to-point messages, whatever N is (a switch that
reduces in the network, like NVLink SHARP, sends less).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


def ring_all_gather(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (N chunks the size of ``input``) gets every rank's ``input``, in rank order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank].copy_(input.view(-1))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step) % n, (rank - step - 1) % n
        works = [comm.isend(chunks[send_c], right, name=f"step {step}: send chunk {send_c}", step=step, chunk=send_c),
                 comm.irecv(chunks[recv_c], left, name=f"step {step}: recv chunk {recv_c}", step=step, chunk=recv_c)]
        for w in works:
            w.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (one chunk) gets the sum over ranks of chunk ``rank`` of ``input`` (N chunks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    acc = input.reshape(n, -1).clone()  # partial sums, updated in place; the input stays untouched
    incoming = torch.empty_like(acc[0])
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step - 1) % n, (rank - step - 2) % n
        works = [comm.isend(acc[send_c], right, name=f"step {step}: send chunk {send_c}", step=step, chunk=send_c),
                 comm.irecv(incoming, left, name=f"step {step}: recv chunk {recv_c}", step=step, chunk=recv_c)]
        for w in works:
            w.wait()
        acc[recv_c] += incoming
    output.view(-1).copy_(acc[rank])


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over ranks in place: pad to N equal chunks, reduce-scatter, all-gather, unpad."""
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    chunk = -(-flat.numel() // n)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype, device=tensor.device)
    padded[:flat.numel()] = flat
    mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
    ring_reduce_scatter(mine, padded)
    ring_all_gather(padded, mine)
    tensor.copy_(padded[:flat.numel()].view_as(tensor))


# -- what moved where, from a real run -----------------------------------------------------------------
def transfers(timeline) -> list[list[tuple[int, int, int]]]:
    """Per step, the (src, dst, chunk) of every message the ring sent, read from a run's timeline."""
    steps: dict[int, list] = {}
    for s in timeline.spans:
        if s.meta.get("op") == "send" and "step" in s.meta:
            steps.setdefault(s.meta["step"], []).append((s.rank, s.meta["peer"], s.meta["chunk"]))
    return [sorted(steps[k]) for k in sorted(steps)]
