"""Lab 06's named mistakes, for the judges in lab06.py: what a wrong answer's data says the learner did.

Each function reads data a check collected (never the learner's code) beside the reference inputs and
returns a sentence naming one mistake and what to do, or None where the data fits none of them (the judge
then says what differed). A mistake is named only from evidence that it happened: a handle never waited
for, gradients equal to those of a per-block softmax, positions that are whole chunks off by one, the rows
of q that each rank attended to, traced back to where they came from."""
from __future__ import annotations

import math

import torch


# -- Task 6.2: a chunk used before it arrived -------------------------------------------------------------------
def never_waited(task: str, where: str, rank: int, ops: list | None) -> str | None:
    """``ops``: the op ("send"/"recv") of each handle the rank's function posted and never waited for."""
    if not ops:
        return None
    recvs, sends = ops.count("recv"), ops.count("send")
    what = " and ".join(f"{k} {op}{'s' if k > 1 else ''}" for k, op in ((recvs, "irecv"), (sends, "isend")) if k)
    return (f"{task}: {where}: rank {rank} never called wait() on {what}. An irecv only posts the receive: the "
            "chunk is in its buffer once that handle's wait() has returned, and read before, the buffer holds "
            "whatever the empty tensor held, or part of the message. Wait for both handles of a hop (after "
            "attending to the chunk you hold) before you attend to the new chunk or send it on.")


def read_before_waited(task: str, where: str, rank: int, in_flight: list | None, every_step: bool) -> str | None:
    """``in_flight``: per attend(), the receives posted and not yet waited for. A ring has at most one (the
    next chunk's) while it computes, and none at its last block (``every_step``: no block was skipped, so the
    last attend is the last step's); more means it attended to (or passed on) a chunk it had not waited for."""
    flight = in_flight or [0]
    if max(flight) <= 1 and not (every_step and flight[-1]):
        return None
    return (f"{task}: {where}: rank {rank} attended to a block with {max(flight)} receive(s) posted and not yet "
            f"waited for{' at its last step, when no chunk is still to come' if max(flight) <= 1 else ''}: the "
            "chunk it held was one of them, read before it had arrived. Wait for each hop's handles before the next "
            "step uses the chunk (attend to it, or send it on).")


# -- Task 6.3: probabilities normalised per block ---------------------------------------------------------------
def per_block_grads(q, k, v, dout, every: list, causal: bool):
    """The whole sequence's (dq, dk, dv) as a ring computes them when each block's probabilities are
    normalised by that block's own softmax (its own lse) instead of the forward's final lse. ``every``:
    each rank's positions. A row that sees no key of a block gets zeros (as a skipped block does)."""
    scale = 1 / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    delta = (dout * out).sum(-1, keepdim=True)
    p = torch.zeros(q.shape[:-1] + (T,), dtype=q.dtype)
    for rows in every:
        for cols in every:
            s = q[..., rows, :] @ k[..., cols, :].transpose(-2, -1) * scale
            if causal:
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            p[..., rows[:, None], cols[None, :]] = torch.softmax(s, -1).nan_to_num(0.0)
    ds = p * (dout @ v.transpose(-2, -1) - delta)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


def per_block_softmax(task: str, where: str, got: list, mistaken: tuple, rows) -> str | None:
    """``got``: one rank's (dq, dk, dv); ``mistaken``: ``per_block_grads`` of the whole sequence."""
    close = [isinstance(g, torch.Tensor) and g.shape == m[..., rows, :].shape
             and (g.double() - m[..., rows, :].double()).nan_to_num(0.0).abs().max().item() < 1e-4
             for g, m in zip(got, mistaken)]
    if not close[2]:  # dv = p^T @ dout: p alone decides it
        return None
    return (f"{task}: {where}: your gradients are those of probabilities normalised per block (each block's own "
            "softmax, or its own log-sum-exp). A block's keys share each query row's denominator with every other "
            "block's keys: p = exp(scores - lse), with the forward's final lse for the row, the same in every block.")


# -- Task 6.4: the zig-zag shard ---------------------------------------------------------------------------------
def zigzag_wrong_dim(probe: dict | None, tokens: int) -> str | None:
    """``probe``: the shape the learner's function returned (or the error it raised) for an x whose every
    dimension cuts into 2 x world_size chunks, (8, 8, T, 8) at world_size 2, rank 0."""
    if not probe or "shape" not in probe:
        return None
    shape = probe["shape"]
    if len(shape) != 4:
        return None
    if shape[2] == tokens:
        dims = [d for d in (0, 1, 3) if shape[d] != 8]
        if dims:
            return (f"you cut dim {dims[0]} of x, not the sequence: x is (..., T, D), its sequence is dim -2. "
                    "x.chunk(2 * world_size, -2) (chunk's default is dim 0), and torch.cat(..., -2).")
    if shape[2] == tokens // 4:
        dims = [d for d in (0, 1, 3) if shape[d] == 16]
        if dims:
            default = " (torch.cat's default)" if dims[0] == 0 else ""
            return (f"you cut the sequence but joined the two chunks along dim {dims[0]}{default}, not the "
                    "sequence: torch.cat([...], -2).")
    return None


def _chunks(got, size: int) -> list | None:
    """The two chunk indices a rank's positions are made of, or None if they are not two whole chunks."""
    if not isinstance(got, list) or len(got) != 2 * size:
        return None
    halves = [got[:size], got[size:]]
    if any(h != list(range(h[0], h[0] + size)) or h[0] % size for h in halves):
        return None
    return [h[0] // size for h in halves]


def zigzag_off_by_one(results: list, tokens: int) -> str | None:
    """``results``: per world size 1..4, each rank's positions (a list) or the error it raised (a str). Named
    when, at a world size of 2 or more, every rank is off by the same one chunk (an index past the end raises
    IndexError on the rank whose chunk would be 2P), or every rank holds its two chunks the other way round."""
    for n, parts in list(enumerate(results, start=1))[1:]:
        size = tokens // (2 * n)
        held = [_chunks(got, size) for got in parts]
        want = [[r, 2 * n - 1 - r] for r in range(n)]
        if all(h == w[::-1] for h, w in zip(held, want)):
            return (f"with {n} ranks, rank r holds chunks 2 x world_size - 1 - r and r, the other way round: rank r "
                    "takes chunks r and 2 x world_size - 1 - r, in that order (the early chunk first).")
        offs = {(h[0] - w[0], h[1] - w[1]) for h, w in zip(held, want) if h is not None}
        errors = [got for got in parts if isinstance(got, str)]
        if len(offs) != 1 or not all(isinstance(got, str) and got.startswith("IndexError") for got in errors) \
                or len(errors) + sum(h is not None for h in held) != n:
            continue
        (d0, d1), = offs
        if (d0, d1) != (0, 0) and abs(d0) <= 1 and abs(d1) <= 1:
            first = "r" if not d0 else f"r {'+' if d0 > 0 else '-'} 1"
            raised = f" (rank {parts.index(errors[0])} raised {errors[0]}: there is no chunk {2 * n})" if errors else ""
            return (f"with {n} ranks, every rank r took chunks {first} and {2 * n - 1 + d1} - r{raised}: off by one. "
                    f"The {2 * n} chunks are numbered 0 to {2 * n - 1}; rank r takes chunks r and {2 * n - 1} - r "
                    "(2 x world_size - 1 - r).")
    return None


# -- Task 6.5: where each row a rank attended to (and returned) came from -----------------------------------------
def origins(got: torch.Tensor, whole: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """For each row (last dim) of ``got``, its (batch, head, token) in ``whole`` (B, H, T, D), -1 where it is
    none of whole's rows: (..., 3). The rows of random inputs (and of their attention) are all different."""
    D = whole.shape[-1]
    rows, flat = got.reshape(-1, D).double(), whole.reshape(-1, D).double()
    dist, index = torch.cdist(rows, flat).min(1)
    _, H, T, _ = whole.shape
    found = torch.stack([index // (H * T), index // T % H, index % T], -1)
    found[dist > tol] = -1
    return found.reshape(got.shape[:-1] + (3,))


def ulysses_mistake(queries, out, q, want, rank: int, n: int) -> str | None:
    """``queries``: the q a rank gave attend() (expected: every token of heads rank·H/P .. in order,
    (B, H/P, T, D)); ``out``: what it returned (expected: its tokens of every head); ``want``: SDPA's output."""
    B, H, T, D = q.shape
    h, t = H // n, T // n
    if isinstance(queries, torch.Tensor) and tuple(queries.shape) != (B, h, T, D):
        return (f"rank {rank} attended with q of shape {tuple(queries.shape)}, expected (B, H/P, T, D) = {(B, h, T, D)}: "
                "after the first all-to-all a rank holds every token of its H/P heads. Send rank j heads j·H/P .. "
                "(j+1)·H/P - 1 of your tokens (cut the heads, dim 1, not the tokens), and join the P chunks that "
                "arrive along the sequence.")
    if isinstance(queries, torch.Tensor) and queries.dtype.is_floating_point:
        b, head, token = origins(queries, q).unbind(-1)
        if (b < 0).any():
            return None
        whole = (b == b[..., :1]).all() and (head == head[..., :1]).all() and (token == torch.arange(T)).all()
        if not whole:
            return (f"rank {rank} attended to sequences that mix heads, batch elements or the tokens' order: the "
                    "received chunks were undone the wrong way on arrival. Chunk j of what arrives holds rank j's T/P "
                    "tokens of your H/P heads, (P, B, H/P, T/P, D): move P next to the tokens and join them, "
                    ".permute(1, 2, 0, 3, 4).reshape(B, H // P, T, D), so rank j's tokens are chunk j of the sequence.")
        if (b != torch.arange(B)[:, None, None]).any():
            return (f"rank {rank} attended to batch element(s) {sorted(set(b.flatten().tolist()))} in place of the "
                    "batch: what it sent was not cut by destination rank. all_to_all cuts dim 0 of what you send "
                    "into P chunks, chunk j to rank j, so dim 0 must be the destination: x.reshape(B, P, H // P, "
                    "T/P, D).transpose(0, 1).contiguous(). Without the transpose (or with a reshape straight to "
                    "(P, B, ...), which only regroups memory) dim 0 cuts the batch, not the heads.")
        heads = head[0, :, 0].tolist()
        if heads != list(range(rank * h, (rank + 1) * h)):
            return (f"rank {rank} attended to heads {heads}, expected {list(range(rank * h, (rank + 1) * h))}: the "
                    "heads were dealt out interleaved (a reshape to (B, H // P, P, ...) sends head i to rank i % P) "
                    "and the way back does not undo that order. Rank j's heads are j·H/P .. (j+1)·H/P - 1: make P the "
                    "outer part of the head dimension, x.reshape(B, P, H // P, T/P, D).")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, H, t, D) or not out.dtype.is_floating_point:
        return None
    b, head, token = origins(out, want).unbind(-1)
    if (b < 0).any():
        return None
    if (b != torch.arange(B)[:, None, None]).any():
        return (f"coming back, rank {rank}'s output mixes batch elements ({sorted(set(b[0].flatten().tolist()))} in "
                "batch element 0): what arrives is (P, B, H/P, T/P, D), chunk j from rank j; transpose(0, 1) to "
                "(B, P, H/P, T/P, D) before the reshape to (B, H, T/P, D).")
    if (token != torch.arange(rank * t, (rank + 1) * t)).any():
        return (f"coming back, rank {rank} got tokens {sorted(set(token.flatten().tolist()))[:6]}..., not its own "
                f"({rank * t} to {(rank + 1) * t - 1}): send rank j its tokens, chunk j of the sequence: "
                "out.reshape(B, H // P, P, T/P, D).permute(2, 0, 1, 3, 4).")
    if (head != torch.arange(H)[None, :, None]).any():
        return (f"coming back, rank {rank}'s heads are in the order {head[0, :, 0].tolist()}: chunk j of what "
                "arrives holds rank j's heads, j·H/P .. (j+1)·H/P - 1, so P is the outer part of the head dimension: "
                ".transpose(0, 1).reshape(B, H, T/P, D).")
    return None
