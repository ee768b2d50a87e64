"""What a timeline says, in numbers: per rank, how long it computed, how much of its communication ran
under that compute (hidden) or in front of it (exposed), how long it waited for a peer, and how long
it sat idle. One definition, used by ``Timeline.summary()`` and drawn under every chart.

Communication is the time a collective or a message is actually under way. A rank that enters a
collective (or a recv) before its last peer has even issued its side is *waiting*, not communicating:
a pipeline bubble looks exactly like this. So is a collective still queued behind the rank's earlier
ones (Gloo runs two at a time, first come first served), where ``lablib.timed`` recorded when the
backend began it. So each comm span is cut in up to three: queued, waiting for a peer, moving:

- point to point: the k-th send from a to b is matched with the k-th recv on b from a; neither side
  can move data before both have posted, so each side waits until the later of the two starts;
- collectives: the k-th collective of an op on every rank of its group (every rank, or the sub-group
  the span names) is one call; it waits until the group's last rank was running it (when every rank of
  the group recorded the same number of calls of that op).

The overlap fraction is hidden communication / communication time, as Holistic Trace Analysis defines its
communication-computation overlap, on every device: on a GPU the spans are where their kernels ran
(``lablib.gputime``), so it is the time NCCL's kernels ran under compute kernels.

Overlap on a CPU is measured, not promised: Gloo's copies run on the same cores as the compute, so a
comm span "hidden" under compute may still have slowed that compute down. Where two runs are compared,
the step-time saving is the number that counts.
"""
from __future__ import annotations

import re
from collections import defaultdict

COMPUTE_OPS = ("forward", "backward", "weight_grad", "compute")
COMM_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier", "send", "recv")
_NAMED = [(re.compile(r"^(fwd|forward|F\d)", re.I), "forward"), (re.compile(r"^(bwd|backward|B\d)", re.I), "backward"),
          (re.compile(r"^(wgrad|weight.grad|W\d)", re.I), "weight_grad")]


def op_of(span) -> str:
    """The operation a span shows: ``meta["op"]`` where a traced collective or the caller set it, else
    read from a compute span's name ("fwd L0", "F3" -> forward; "bwd", "B2" -> backward; "W1" -> weight
    gradient), else "compute" or "comm"."""
    op = span.meta.get("op")
    if op:
        return op
    if span.kind == "compute":
        return next((op for pattern, op in _NAMED if pattern.match(span.name)), "compute")
    return span.kind


# -- intervals ------------------------------------------------------------------------------------------
def union(intervals) -> list[tuple[float, float]]:
    out = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(xs, ys) -> list[tuple[float, float]]:
    xs, ys, out, i, j = union(xs), union(ys), [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


# -- who waited for whom --------------------------------------------------------------------------------
def messages(spans) -> list[tuple]:
    """(send span, recv span) pairs: the k-th send from a to b with the k-th recv on b from a (messages
    between two ranks match in the order posted, as under NCCL, which has no tags)."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for s in sorted(spans, key=lambda s: s.start):
        if s.meta.get("op") == "send" and "peer" in s.meta:
            sends[(s.rank, s.meta["peer"])].append(s)
        elif s.meta.get("op") == "recv" and "peer" in s.meta:
            recvs[(s.meta["peer"], s.rank)].append(s)
    return [pair for key in sends for pair in zip(sends[key], recvs.get(key, []))]


def ready_times(spans, world_size: int) -> dict[int, float]:
    """For each comm span (by id), when its data could start moving: the latest moment its partners
    (itself included) were running it (``Span.running``: issued, or begun by the backend where that is
    known)."""
    ready = {}
    for send, recv in messages(spans):
        ready[id(send)] = ready[id(recv)] = max(send.running, recv.running)
    calls = defaultdict(lambda: defaultdict(list))  # (op, its group's ranks, () for all) -> rank -> spans in order
    for s in sorted(spans, key=lambda s: s.start):
        op = s.meta.get("op")
        if s.kind == "comm" and op and op not in ("send", "recv") and s.depth == 0:
            calls[op, tuple(s.meta.get("group", ()))][s.rank].append(s)
    for (op, group), by_rank in calls.items():
        counts = {len(v) for v in by_rank.values()}
        if len(by_rank) != (len(group) or world_size) or len(counts) != 1:
            continue  # not every rank called it the same number of times: no matching to trust
        for k in range(counts.pop()):
            last = max(by_rank[r][k].running for r in by_rank)
            for r in by_rank:
                ready[id(by_rank[r][k])] = last
    return ready


def phases(spans, world_size: int) -> dict[int, tuple[float, float]]:
    """For each comm span (by id), ``(running, moving)``: it was queued from its start to ``running``
    (behind the rank's earlier collectives, where ``lablib.timed`` saw it), waited for a peer from there
    to ``moving``, and moved data from ``moving`` to its end."""
    ready = ready_times(spans, world_size)
    out = {}
    for s in spans:
        if s.kind == "comm":
            running = s.running
            out[id(s)] = running, min(max(ready.get(id(s), running), running), s.end)
    return out


# -- the numbers --------------------------------------------------------------------------------------
def breakdown(spans, world_size: int) -> dict[int, dict[str, float]]:
    """Seconds per rank: compute, comm (hidden + exposed: data moving), hidden, exposed, waiting (in a
    collective or recv, not computing, with no data moving: queued, or waiting for a peer), idle, and
    the overlap fraction hidden / comm. Idle is the rest of the job's window (first to last span of any
    rank) and includes waiting."""
    spans = [s for s in spans if s.kind in ("compute", "comm")]
    lo = min((s.start for s in spans), default=0.0)
    hi = max((s.end for s in spans), default=0.0)
    cut = phases(spans, world_size)
    out = {}
    for r in range(world_size):
        mine = [s for s in spans if s.rank == r]
        compute = union((s.start, s.end) for s in mine if s.kind == "compute" and not s.is_async)
        moving, waiting = [], []
        for s in mine:
            if s.kind != "comm":
                continue
            t = cut[id(s)][1]
            waiting.append((s.start, t))  # queued or waiting for a peer: no data moved
            moving.append((t, s.end))
        moving = union(moving)
        hidden = length(intersect(moving, compute))
        comm = length(moving)
        wait = length(waiting) - length(intersect(waiting, compute + moving))
        busy = length(compute + moving)
        out[r] = {"compute": length(compute), "comm": comm, "hidden": hidden, "exposed": comm - hidden,
                  "waiting": max(wait, 0.0), "idle": max(hi - lo - busy, 0.0),
                  "overlap": hidden / comm if comm > 0 else 0.0}
    return out


def hidden_fraction(timeline) -> float:
    """Of all ranks' communication in ``timeline``, the fraction that ran under compute."""
    rows = breakdown(timeline.spans, timeline.world_size).values()
    comm = sum(r["comm"] for r in rows)
    return sum(r["hidden"] for r in rows) / comm if comm else 0.0
