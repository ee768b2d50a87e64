"""Context parallelism: a long sequence split over ranks for attention itself (lab 06's harness).

Attention of a query block against a key/value block gives that block's output and, per query row, the
log-sum-exp of its scores; blocks then merge exactly (the online softmax of Milakov & Gimelshein 2018,
arXiv:1805.02867, and FlashAttention, Dao et al. 2022, arXiv:2205.14135). Ring attention (Liu et al.
2023, arXiv:2310.01889) keeps each rank's queries and passes the key/value chunks around the ring; the
all-to-all of DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509) instead trades the sequence split
for a split by heads around a local attention. Llama 3 (Dubey et al. 2024, arXiv:2407.21783, §3.3.2) ran neither:
each rank all-gathers every rank's K and V once and attends its (zig-zag) queries to all of them
(``allgather_attention``), as PyTorch's ``context_parallel`` does by default.

Here: one block's attention (``attend``) with positions, so a causal mask holds across chunks, the
layouts (which positions each rank holds: contiguous or zig-zag), the work a layout gives each rank,
and the single-process reference. The lab's answers are in ``lablib.answers.lab06``.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..timeline import noted, span
from ..toy import seeded

_BLOCKS: list = [None]  # (query rows, key rows) of each attend() while a check holds a list here
_IN_FLIGHT: list = [None]  # per attend(), the receives posted and not yet waited for (comm.watched's works)
_QUERIES: list = [None]  # the queries of each attend() while a check holds a list here (where each row came from)


class _AttentionTime:
    """The time this rank spent in ``attend()`` since ``ring_job`` last reset it, on the clock its work runs
    on: its thread's CPU time on the CPU (ranks that share cores take turns, and wall time would show the
    turns), its kernels' time on a GPU (CUDA events around each block, read after one synchronisation)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.cpu, self.events = 0.0, []

    @contextmanager
    def measure(self, on_gpu: bool):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((start, end))
            return
        cpu = time.thread_time()
        try:
            yield
        finally:
            self.cpu += time.thread_time() - cpu

    def seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
        return self.cpu + sum(a.elapsed_time(b) for a, b in self.events) / 1e3


_ATTN_TIME = _AttentionTime()


def attend(q, k, v, q_pos, k_pos, causal: bool):
    """One block: q (B, H, Tq, D) against k, v (B, H, Tk, D); ``q_pos``, ``k_pos``: the tokens' positions in
    the whole sequence (a causal query sees the keys at its position and before). Returns the block's
    output (B, H, Tq, D) and per query row the log-sum-exp of its scaled scores (B, H, Tq): -inf, and an
    output of zeros, for a row that sees no key of this block. Under a causal mask it computes only the
    keys a run of consecutive queries can see, as an attention kernel skips masked tiles: a zig-zag chunk
    costs what it sees, not the whole block."""
    if _BLOCKS[0] is not None:
        _BLOCKS[0].append((q.shape[-2], k.shape[-2]))
    if _IN_FLIGHT[0] is not None:
        from ..comm import WORKS

        _IN_FLIGHT[0].append(sum(1 for w in WORKS[0] or () if w.op == "recv" and not w.waited))
    if _QUERIES[0] is not None:
        _QUERIES[0].append(q.detach().cpu().clone())
    with span(f"attn {q.shape[-2]}x{k.shape[-2]}", "compute"), _ATTN_TIME.measure(q.is_cuda):
        if not causal:
            return _attend(q, k, v, None)
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_full(q.shape[:-1], float("-inf"))
        for a, b in _runs(q_pos):
            rows = q_pos[a:b]
            seen = [torch.arange(c, d, device=k.device) for c, d in _runs(k_pos) if k_pos[c] <= rows[-1]]
            if seen:
                keys = torch.cat(seen)
                out[..., a:b, :], lse[..., a:b] = _attend(q[..., a:b, :], k[..., keys, :], v[..., keys, :],
                                                          k_pos[keys][None, :] > rows[:, None])
        return out, lse


def _attend(q, k, v, masked):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])                # (B, H, Tq, Tk)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                    # (B, H, Tq)
    seen = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)         # exp(-inf - -inf) would be NaN
    return torch.exp(scores - seen[..., None]) @ v, lse


def _runs(pos) -> list[tuple[int, int]]:
    """[start, end) index ranges of consecutive positions (one for a contiguous chunk, two for zig-zag)."""
    breaks = ((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist()
    edges = [0, *breaks, len(pos)]
    return list(zip(edges[:-1], edges[1:]))


def blocks_of(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the (query rows, key rows) of every block ``attend`` computed meanwhile."""
    return noted(_BLOCKS, fn, *args, **kwargs)


def queries_of(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the queries of every block ``attend`` computed meanwhile (CPU copies)."""
    return noted(_QUERIES, fn, *args, **kwargs)


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


def reference_lse(q, k, causal: bool):
    """The whole sequence's log-sum-exp of scaled scores per query row (B, H, T): what a blockwise
    attention must end with."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    return torch.logsumexp(scores, -1)


# -- measured: the ring on the ranks, the memory it holds, the bytes it moves ---------------------------------
BIG = dict(batch=1, heads=8, tokens=2048, dim=32)  # the measured sequence: 2048 tokens, 8 heads of 32


def allgather_attention(q, k, v, positions, causal: bool, group=None):
    """Llama 3's context parallelism: this rank's queries against every rank's keys and values, gathered
    once. ``positions[r]``: the positions rank r holds (zig-zag balances the causal work, as Llama 3 did).
    Returns (out, lse). Each rank then holds the whole sequence's K and V, P times the ring's chunk, and the
    all-gather hides under nothing: attention waits for it (PyTorch's default "allgather" rotation posts it
    before attending to the rank's own chunk, so it can hide under that one block)."""
    import torch.distributed as dist

    from .. import comm

    n, r = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.stack([k, v])                                               # (2, B, H, T/P, D)
    every = mine.new_empty((n * 2,) + tuple(mine.shape[1:]))                 # (P·2, B, H, T/P, D)
    comm.all_gather(every, mine, group=group, name="all-gather K/V")
    B, H, t, D = k.shape
    every = every.view(n, 2, B, H, t, D)                                     # rank r's K and V at [r]
    keys, values = (every[:, i].permute(1, 2, 0, 3, 4).reshape(B, H, n * t, D) for i in (0, 1))  # rank order
    return attend(q, keys, values, positions[r], torch.cat(list(positions)), causal)


def ring_job(fn, layout: str = "contiguous", causal: bool = True, steps: int = 2, ulysses: bool = False,
             link=None, output: bool = False, **size) -> dict:
    """``steps`` forwards of ring attention ``fn(q, k, v, positions, causal)`` (``ulysses``: all-to-all
    attention ``fn(q, k, v, causal)``, contiguous) on this rank's part of the ``BIG`` sequence (``size``
    overrides it), after a warm-up; the timeline records the last. ``link``: messages over a simulated
    link (``comm.LINKS``). Returns the seconds of each step, the CPU seconds this rank's thread spent in
    the last (its compute, whether or not it had a core to itself), the seconds of it spent in ``attend``
    (``attention``: CPU time on the CPU, GPU time on a GPU: ``_AttentionTime``), and
    its attention work (causal query-key pairs); ``output``: also the last step's output and this rank's positions (CPU)."""
    import torch.distributed as dist

    from .. import comm
    from .prefetch import timed_steps

    r, n = dist.get_rank(), dist.get_world_size()
    s = {**BIG, **size}
    mine = positions(layout, r, n, s["tokens"])  # on the CPU, to cut the CPU-made sequence with
    every = [comm.to_device(positions(layout, p, n, s["tokens"])) for p in range(n)]
    q, k, v = (comm.to_device(t[..., mine, :].contiguous()) for t in qkv(s["batch"], s["heads"], s["tokens"], s["dim"]))
    def step():
        _ATTN_TIME.reset()
        return fn(q, k, v, causal) if ulysses else fn(q, k, v, every, causal)

    seconds, cpu, out = timed_steps(steps, link, step)
    whole = torch.arange(s["tokens"])
    return {"seconds": seconds, "cpu": cpu, "attention": _ATTN_TIME.seconds(),
            "work": causal_pairs(mine, whole) if causal else len(mine) * s["tokens"],
            **({"out": (out[0] if isinstance(out, tuple) else out).cpu(), "rows": every[r].cpu()} if output else {})}


def versus_sdpa(results, causal: bool, **size) -> float:
    """The largest difference between the ranks' outputs (``ring_job(..., output=True)``), put back in
    sequence order, and PyTorch's SDPA on the whole ``BIG`` sequence (``size`` overrides it)."""
    s = {**BIG, **size}
    q, k, v = qkv(s["batch"], s["heads"], s["tokens"], s["dim"])
    want = reference(q, k, v, causal)
    got = torch.empty_like(want)
    for r in results:
        got[..., r["rows"], :] = r["out"]
    return (got - want).abs().max().item()


def median_run(cluster, fn, layout: str, causal: bool, runs: int = 3, **kwargs):
    """``runs`` separate runs of one timed step each (``ring_job``, after its warm-up), and the one whose
    step (its slowest rank) took the median time: (its per-rank results, its timeline, its step's seconds),
    each result with ``attention_median``, that rank's median over the runs of its seconds in attention (CPU
    time on the CPU, GPU time on a GPU). The timeline drawn is then the step whose time is printed."""
    done = []
    for _ in range(runs):
        results = cluster.run(ring_job, fn, layout, causal, 1, **kwargs)
        done.append((max(r["seconds"][0] for r in results), results, cluster.timeline()))
    seconds, results, timeline = sorted(done, key=lambda d: d[0])[len(done) // 2]
    for rank, r in enumerate(results):
        r["attention_median"] = statistics.median(d[1][rank]["attention"] for d in done)
    return results, timeline, seconds


def transfer_seconds(timeline) -> list[float]:
    """How long each send of ``timeline`` took, from posted to delivered (seconds)."""
    return [s.duration for s in timeline.spans if s.kind == "comm" and s.meta.get("op") == "send"]


def saved_job(fn, tokens: int, heads: int = 4, dim: int = 32, causal: bool = True) -> int:
    """On this rank: the bytes autograd keeps for the backward when it differentiates through ring
    attention ``fn`` on this rank's part (contiguous) of a ``tokens``-long sequence (every block's scores
    and probabilities): activation memory per rank, measured."""
    import torch.distributed as dist

    from .. import comm
    from .tensor_parallel import saved_bytes

    r, n = dist.get_rank(), dist.get_world_size()
    every = [comm.to_device(positions("contiguous", p, n, tokens)) for p in range(n)]
    q, k, v = (comm.to_device(t[..., every[r], :].contiguous()).requires_grad_() for t in qkv(1, heads, tokens, dim))
    return saved_bytes(fn, q, k, v, every, causal, params=())


def saved_single(tokens: int, heads: int = 4, dim: int = 32, causal: bool = True) -> int:
    """The same in one process, attention on the whole sequence (P = 1)."""
    from .tensor_parallel import saved_bytes

    q, k, v = (t.requires_grad_() for t in qkv(1, heads, tokens, dim))
    pos = torch.arange(tokens)
    return saved_bytes(attend, q, k, v, pos, pos, causal, params=())


def memory_rows(cluster, fn, tokens=(256, 512, 1024)) -> list[dict]:
    """Per sequence length and P = 1, 2, 4: the bytes autograd keeps per rank through ring attention ``fn``
    (P = 1: one process, the whole sequence; P = 2 on a spare pool, P = 4 on ``cluster``, of 4 ranks) and
    what Task 6.3's recomputing backward keeps, for ``views.context_parallel.memory_figure``."""
    from ..pool import spare

    rows = []
    for t in tokens:
        rows.append({"P": 1, "tokens": t, "saved": saved_single(t), "kept": kept_for_recompute(t, 1)})
        for p, pool in ((2, spare(2)), (4, cluster)):
            rows.append({"P": p, "tokens": t, "saved": max(pool.run(saved_job, fn, t)), "kept": kept_for_recompute(t, p)})
    return rows


def kept_for_recompute(tokens: int, world_size: int, heads: int = 4, dim: int = 32) -> int:
    """What a rank keeps for Task 6.3's backward, which recomputes each block from the saved lse: its q,
    k, v and out (fp32) and the lse (one number per query row and head)."""
    rows = tokens // world_size
    return 4 * rows * heads * dim * 4 + rows * heads * 4


def three_ways(cluster, ring, ulysses, layout: str = "zigzag", causal: bool = True, **size) -> list[dict]:
    """Ring attention ``ring``, all-to-all attention ``ulysses`` (contiguous, its layout) and
    ``allgather_attention`` on ``cluster``, one forward of the ``BIG`` sequence each: per way, rank 0's bytes
    sent (measured, from the timeline; and by formula), the K/V a rank holds (counted) and the share of the
    ranks' communication that ran under attention (measured), for ``views.context_parallel.three_ways``.
    ``size`` overrides ``BIG``."""
    from ..overlap import hidden_fraction
    from ..traffic import bytes_sent

    n, s = cluster.world_size, {**BIG, **size}
    sent, held = (f(s["tokens"], s["heads"], s["dim"], n, s["batch"]) for f in (ring_bytes, kv_held))
    rows = []
    for name, fn, a2a in (("ring", ring, False), ("all-to-all", ulysses, True), ("all-gather", allgather_attention, False)):
        cluster.run(ring_job, fn, "contiguous" if a2a else layout, causal, 1, a2a, **size)
        timeline = cluster.timeline()
        rows.append({"way": name, "sent": bytes_sent(timeline, rank=0), "formula": sent[name], "held": held[name],
                     "hidden": hidden_fraction(timeline)})
    return rows


def ring_bytes(tokens: int, heads: int, dim: int, world_size: int, batch: int = 1) -> dict:
    """Bytes one rank sends in a forward, by formula (fp32): the ring passes its K and V chunk P-1 times;
    all-to-all attention sends (P-1)/P of its q, k, v and output chunks once each; the all-gather (a ring
    all-gather, as Gloo's and NCCL's) passes P-1 K/V chunks too, the ring's bytes in one collective."""
    chunk = batch * heads * tokens // world_size * dim * 4
    return {"ring": 2 * chunk * (world_size - 1), "all-to-all": 4 * chunk * (world_size - 1) / world_size,
            "all-gather": 2 * chunk * (world_size - 1)}


def kv_held(tokens: int, heads: int, dim: int, world_size: int, batch: int = 1) -> dict:
    """Bytes of keys and values a rank holds at once for its attention, counted (fp32): the ring, the chunk
    it attends to and the one arriving (2 chunks); all-to-all attention, every token of its H/P heads (one
    chunk's worth); the all-gather, every rank's chunk (P chunks: the whole sequence's K and V)."""
    chunk = 2 * batch * heads * tokens // world_size * dim * 4
    return {"ring": 2 * chunk, "all-to-all": chunk, "all-gather": world_size * chunk}


# Llama 3 405B at 128k tokens (Dubey et al. 2024, Table 4: CP 16): 128 query heads, 8 key/value heads of 128
LLAMA3_405B = dict(tokens=131072, cp=16, heads=128, kv_heads=8, dim=128)
H100_BF16 = 989e12  # FLOP/s, dense BF16, H100 SXM datasheet
NIC = 50e9          # bytes/s: one 400 Gb/s NIC a GPU, as Llama 3's RoCE fabric


def gqa_allgather(tokens: int, cp: int, heads: int, kv_heads: int, dim: int) -> dict:
    """Modelled, one layer's forward on one GPU (tensor parallelism divides both terms alike): the bytes of
    K and V its all-gather receives, (P-1)/P x 2 x T x kv_heads x d x 2 (BF16), and the FLOPs of its causal
    attention, 2 x T x T x heads x d / P (Q·Kᵀ and P·V, 2 FLOPs a multiply-add, half the pairs causal), with
    their times at the H100's datasheet peak and one 400 Gb/s NIC (``H100_BF16``, ``NIC``)."""
    received = (cp - 1) / cp * 2 * tokens * kv_heads * dim * 2
    flops = 2 * tokens * tokens * heads * dim / cp
    return {"bytes": received, "flops": flops, "comm_s": received / NIC, "attention_s": flops / H100_BF16}


def modelled_activations(tokens: int, world_size: int, hidden: int = 4096, layers: int = 32) -> float:
    """Modelled bytes of activations a GPU holds for one sequence of ``tokens``, activations only: Korthikanti
    et al.'s 34·s·b·h bytes per layer (b = 1), their count for a GPT-style layer in 16-bit (BF16) without the
    5·a·s²·b of the attention matrices, which FlashAttention and ring attention never keep, split by context
    parallelism over ``world_size`` GPUs; h = 4096 and 32 layers, an 8B model's sizes. A Llama layer (SwiGLU,
    grouped-query attention, no dropout) keeps a different amount; weights, gradients and optimizer state
    come on top."""
    return 34 * tokens * hidden * layers / world_size
