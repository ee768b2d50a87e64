"""lablib's context parallelism: the online-softmax merge, ring attention forward and backward, and the
all-to-all (Ulysses) attention (the harness, ``attend`` and the layouts, is ``strategies.context_parallel``)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm, messages
from ..strategies.context_parallel import attend

TASKS = {"Task 6.1": ("merge", "blockwise_attention"), "Task 6.2": ("ring_attention",),
         "Task 6.3": ("ring_attention_backward",), "Task 6.4": ("zigzag_shard",), "Task 6.5": ("ulysses_attention",)}


def merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries, each normalised over its own keys, as one: rescale
    each by exp(its lse - the new lse). A row that saw no key in either stays zeros with lse -inf."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None], new


def blockwise_attention(q, k, v, block: int, causal: bool):
    """Attention of the whole sequence, one key/value block of ``block`` tokens at a time (one process)."""
    pos = torch.arange(q.shape[-2], device=q.device)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    for start in range(0, k.shape[-2], block):
        part = slice(start, start + block)
        out, lse = merge(out, lse, *attend(q, k[..., part, :], v[..., part, :], pos, pos[part], causal))
    return out, lse


def _ring(rank: int, n: int):
    return (rank + 1) % n, (rank - 1) % n


def ring_attention(q, k, v, positions, causal: bool):
    """This rank's queries against every rank's keys and values, passed round the ring: at each step the
    next chunk's transfer is posted before this one is computed, so it travels under the compute. The send
    right and the receive from the left go as one exchange: posted apart, NCCL may deadlock on them.
    ``positions[r]``: the positions rank r holds. Returns (out, lse) of this rank's queries."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = _ring(rank, n)
    pos = positions[rank]
    held = torch.stack([k, v])
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), device=q.device)
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            incoming = torch.empty_like(held)
            hop = messages.exchange(sends=[(held, right)], recvs=[(incoming, left)], name=f"hop {step}")
        k_pos = positions[src]
        if not causal or k_pos.min() <= pos.max():  # a block wholly above the diagonal is skipped
            out, lse = merge(out, lse, *attend(q, held[0], held[1], pos, k_pos, causal))
        if step < n - 1:
            hop.wait()
            held = incoming
    return out, lse


def ring_attention_backward(q, k, v, positions, out, lse, grad_out, causal: bool):
    """dq, dk, dv of this rank's chunk: each block's gradients recomputed from the saved lse (the
    probabilities are exp(scores - lse)); dk and dv travel with their key/value chunk and arrive home
    after the full circle of n hops."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = _ring(rank, n)
    scale = 1 / math.sqrt(q.shape[-1])
    pos = positions[rank]
    delta = (grad_out * out).sum(-1, keepdim=True)                                     # (B, H, Tq, 1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
    dq = torch.zeros_like(q)
    travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])         # K, V, dK, dV
    for step in range(n):
        src = (rank - step) % n
        kk, vv, dk, dv = travelling
        k_pos = positions[src]
        if not causal or k_pos.min() <= pos.max():
            scores = q @ kk.transpose(-2, -1) * scale
            if causal:
                scores = scores.masked_fill(k_pos[None, :] > pos[:, None], float("-inf"))
            p = torch.exp(scores - safe)                                               # (B, H, Tq, Tk)
            dv += p.transpose(-2, -1) @ grad_out
            ds = p * (grad_out @ vv.transpose(-2, -1) - delta)
            dq += ds @ kk * scale
            dk += ds.transpose(-2, -1) @ q * scale
        incoming = torch.empty_like(travelling)
        messages.exchange(sends=[(travelling, right)], recvs=[(incoming, left)], name=f"hop {step}").wait()
        travelling = incoming
    return dq, travelling[2], travelling[3]  # after n hops, this rank's own dK and dV are back


def zigzag_shard(x, rank: int, world_size: int, dim: int = -2):
    """Rank ``rank``'s part of x along ``dim`` in the zig-zag layout: chunks r and 2P-1-r of 2P."""
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def ulysses_attention(q, k, v, causal: bool):
    """q, k, v (B, H, T/P, D), this rank's tokens (contiguous): all-to-all to (B, H/P, T, D), every token of
    this rank's heads; attention on the whole sequence; all-to-all back."""
    n = dist.get_world_size()

    def to_heads(x):                       # (B, H, T/P, D) -> (B, H/P, T, D)
        B, H, t, D = x.shape
        send = x.reshape(B, n, H // n, t, D).transpose(0, 1).contiguous()  # chunk j: heads for rank j
        got = torch.empty_like(send)
        comm.all_to_all(got, send)                                          # chunk j: rank j's tokens
        return got.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, D)

    def to_tokens(x):                      # (B, H/P, T, D) -> (B, H, T/P, D)
        B, h, T, D = x.shape
        send = x.reshape(B, h, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's tokens
        got = torch.empty_like(send)
        comm.all_to_all(got, send)                                                # chunk j: rank j's heads
        return got.transpose(0, 1).reshape(B, n * h, T // n, D)

    pos = torch.arange(q.shape[-2] * n, device=q.device)
    out, _ = attend(to_heads(q), to_heads(k), to_heads(v), pos, pos, causal)
    return to_tokens(out)
