"""What a timeline's traced collectives sent: the ring algorithms' bytes per rank (``comm.bytes_sent``), and on
Gloo the bytes the kernel counted on the sockets (``comm.bytes_on_wire``)."""
from __future__ import annotations

import os

# Bytes one rank sends, as a fraction of a collective's full size S, in the bandwidth-optimal ring
# algorithms (S: the all-gather's output, the reduce-scatter's input, the all-reduce's tensor).
# nccl-tests' bus bandwidth is algbw times the same factor.
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,   # reduce-scatter, then all-gather
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
    "memcpy": lambda n: 1.0,
}


def ring_steps(op: str, n: int) -> int:
    """Messages each rank sends in the ring algorithm on ``n`` ranks: N-1 steps for an all-gather or a
    reduce-scatter, 2(N-1) for an all-reduce (a reduce-scatter, then an all-gather)."""
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def bytes_sent(timeline, rank: int | None = None) -> float:
    """Bytes sent, by the ring algorithms, in the traced collectives of ``timeline`` (one rank, or the
    average over ranks)."""
    ranks = [rank] if rank is not None else list(range(timeline.world_size))
    n = timeline.world_size
    total = 0.0
    for s in timeline.spans:
        if s.kind == "comm" and s.rank in ranks and "op" in s.meta:
            if "to" in s.meta:  # an all-to-all: what it sent to the other ranks, however uneven
                total += sum(b for j, b in enumerate(s.meta["to"]) if j != s.rank)
                continue
            size = len(s.meta.get("group", ())) or n  # a sub-group's collective runs among its ranks only
            full = (s.bytes or 0) * (size if s.meta["op"] == "all_gather" else 1)  # a span records the input
            total += BUS_FACTOR[s.meta["op"]](size) * full
    return total / len(ranks)


def bytes_on_wire(timeline, rank: int | None = None) -> float | None:
    """Bytes really sent, as the kernel counted them, in the traced synchronous collectives of
    ``timeline`` (one rank, or the average over ranks); None when a span has no count (NCCL, async
    calls, no /proc)."""
    ranks = [rank] if rank is not None else list(range(timeline.world_size))
    spans = [s for s in timeline.spans if s.kind == "comm" and s.rank in ranks and "op" in s.meta]
    if not spans or any("wire" not in s.meta for s in spans):
        return None
    return sum(s.meta["wire"] for s in spans) / len(ranks)


_IO = [None, None]  # (pid, fd): /proc/self/io, opened once by each process (a forked rank opens its own)


def written() -> int | None:
    """Bytes this process has written so far ("wchar" of /proc/self/io; Gloo sends with writev), or
    None where the kernel does not say. One pread of a file kept open (1 µs, where opening it each time
    takes 5): a traced collective reads it twice."""
    try:
        if _IO[0] != os.getpid():
            _IO[:] = [os.getpid(), os.open("/proc/self/io", os.O_RDONLY)]
        data = os.pread(_IO[1], 512, 0)
        at = data.index(b"wchar:")
        return int(data[at + 6:data.index(b"\n", at)])
    except (OSError, ValueError):
        return None
