"""Context parallelism: a long sequence split over ranks for attention itself (lab 06's harness).

Attention of a query block against a key/value block gives that block's output and, per query row, the
log-sum-exp of its scores; blocks then merge exactly (the online softmax of Milakov & Gimelshein 2018,
arXiv:1805.02867, and FlashAttention, Dao et al. 2022, arXiv:2205.14135). Ring attention (Liu et al.
2023, arXiv:2310.01889) keeps each rank's queries and passes the key/value chunks around the ring; the
all-to-all of DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509) instead trades the sequence split
for a split by heads around a local attention.

Here: one block's attention (``attend``) with positions, so a causal mask holds across chunks, the
layouts (which positions each rank holds: contiguous or zig-zag), the work a layout gives each rank,
and the single-process reference. The lab's answers are in ``lablib.answers.lab06``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..toy import seeded


def attend(q, k, v, q_pos, k_pos, causal: bool):
    """One block: q (B, H, Tq, D) against k, v (B, H, Tk, D); ``q_pos``, ``k_pos``: the tokens' positions in
    the whole sequence (a causal query sees the keys at its position and before). Returns the block's
    output (B, H, Tq, D) and per query row the log-sum-exp of its scaled scores (B, H, Tq): -inf, and an
    output of zeros, for a row that sees no key of this block."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])            # (B, H, Tq, Tk)
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                # (B, H, Tq)
    seen = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)     # exp(-inf - -inf) would be NaN
    return torch.exp(scores - seen[..., None]) @ v, lse


def positions(layout: str, rank: int, world_size: int, tokens: int) -> torch.Tensor:
    """The positions rank ``rank`` holds of a ``tokens``-long sequence: "contiguous" (chunk r of P) or
    "zigzag" (chunks r and 2P-1-r of 2P, so causal work is even)."""
    if layout == "contiguous":
        size = tokens // world_size
        return torch.arange(rank * size, (rank + 1) * size)
    if layout == "zigzag":
        size = tokens // (2 * world_size)
        first, second = rank, 2 * world_size - 1 - rank
        return torch.cat([torch.arange(first * size, (first + 1) * size), torch.arange(second * size, (second + 1) * size)])
    raise ValueError(f"no layout {layout!r}: contiguous or zigzag")


def causal_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """How many (query, key) pairs a causal attention computes between these positions: its work."""
    return int((k_pos[None, :] <= q_pos[:, None]).sum())


def work_per_rank(layout: str, world_size: int, tokens: int) -> list[int]:
    """Each rank's causal (query, key) pairs over the whole ring, for a layout: contiguous gives rank P-1
    2P-1 times rank 0's; zig-zag gives every rank the same."""
    every = torch.arange(tokens)
    return [causal_pairs(positions(layout, r, world_size, tokens), every) for r in range(world_size)]


def qkv(batch: int, heads: int, tokens: int, dim: int, seed: int = 0):
    """The whole sequence's q, k, v (B, H, T, D), the same on every rank (a check shards them)."""
    with seeded(seed):
        return tuple(torch.randn(batch, heads, tokens, dim) for _ in range(3))


def reference(q, k, v, causal: bool):
    """Single-process attention on the whole sequence: PyTorch's SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
