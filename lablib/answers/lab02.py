"""Lab 02's answers: ring all-gather, reduce-scatter and all-reduce from point-to-point messages (the
model they follow, and reading what moved from a run, are in ``strategies.ring``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import messages

TASKS = {"Task 2.1": ("ring_all_gather_blocking",), "Task 2.2": ("ring_all_gather",),
         "Task 2.3": ("ring_reduce_scatter",), "Task 2.4": ("ring_all_reduce",)}


def ring_all_gather_blocking(output: torch.Tensor, input: torch.Tensor) -> None:
    """The ring all-gather with blocking send and recv: even ranks send first, odd ranks receive first,
    so no two neighbours both wait to send."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank].copy_(input.view(-1))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step) % n, (rank - step - 1) % n
        if rank % 2 == 0:
            messages.send(chunks[send_c], right)
            messages.recv(chunks[recv_c], left)
        else:
            messages.recv(chunks[recv_c], left)
            messages.send(chunks[send_c], right)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (N chunks the size of ``input``) gets every rank's ``input``, in rank order. Each step's send
    and receive go as one exchange: posted apart, NCCL could run every rank's send first and deadlock."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank].copy_(input.view(-1))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step) % n, (rank - step - 1) % n
        messages.exchange(sends=[(chunks[send_c], right, {"chunk": send_c})],
                      recvs=[(chunks[recv_c], left, {"chunk": recv_c})], name=f"step {step}", step=step).wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` (one chunk) gets the sum over ranks of chunk ``rank`` of ``input`` (N chunks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    acc = input.reshape(n, -1).clone()  # partial sums, updated in place; the input stays untouched
    incoming = torch.empty_like(acc[0])
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (rank - step - 1) % n, (rank - step - 2) % n
        messages.exchange(sends=[(acc[send_c], right, {"chunk": send_c})], recvs=[(incoming, left, {"chunk": recv_c})],
                      name=f"step {step}", step=step).wait()
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
