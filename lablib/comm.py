"""Traced collectives: the ``torch.distributed`` calls the labs use, each recorded as a comm span.

Same arguments as ``torch.distributed``; ``name=`` labels the span. Synchronous calls are timed from
call to return; ``async_op=True`` calls return a ``Work`` whose span runs from issue to completion
(seen by a callback on the work's future, not by when ``wait()`` was called).

``bytes`` on a span is the tensor this rank contributes (for an all-gather, its input: nccl-tests'
"size" is the whole output); what crosses the wire depends on the algorithm and is the subject of
lab 02. ``bytes_sent`` models that traffic for the ring algorithms; on Gloo each synchronous span
also carries ``wire``, the bytes this rank really wrote to its sockets during the call (the
kernel's count, /proc/self/io), and ``bytes_on_wire`` adds those up.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .timeline import RECORDER, AsyncSpan, span

# torch.distributed's own tensor-in/tensor-out collectives, untraced (for references, checks and timing
# loops). PyTorch 2.13 renamed them and warns on the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Work:
    """Wraps a ``torch.distributed`` work handle so its span closes when the work completes."""

    def __init__(self, work, trace: AsyncSpan):
        self._work, self._span = work, trace
        try:
            work.get_future().add_done_callback(trace.close)
        except (RuntimeError, AttributeError):  # some backends' send/recv works have no future
            pass

    def wait(self, *args):
        out = self._work.wait(*args)
        self._span.close()
        return out

    def is_completed(self):
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


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
            full = (s.bytes or 0) * (n if s.meta["op"] == "all_gather" else 1)  # a span records the input
            total += BUS_FACTOR[s.meta["op"]](n) * full
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


def written() -> int | None:
    """Bytes this process has written so far ("wchar" of /proc/self/io; Gloo sends with writev), or
    None where the kernel does not say."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _traced(name, nbytes, async_op, call, tensor, op, **meta):
    if async_op:
        return Work(call(), AsyncSpan(name, "comm", nbytes, op=op, **meta))
    with span(name, "comm", bytes=nbytes, op=op, **meta) as s:
        # Only while recording: a timing loop (bandwidth.sweep) must not pay two /proc reads a message.
        before = written() if RECORDER.spans is not None and not tensor.is_cuda else None
        out = call()
        if tensor.is_cuda:  # NCCL returns at enqueue; time the transfer, not the launch
            torch.cuda.synchronize(tensor.device)
        elif before is not None:
            s.meta["wire"] = written() - before
    return out


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, name="all_reduce"):
    return _traced(name, tensor.nbytes, async_op, lambda: dist.all_reduce(tensor, op, group, async_op), tensor,
                   "all_reduce")


def all_gather(output, input, group=None, async_op=False, name="all_gather"):
    """``output`` (world_size * n elements) receives every rank's ``input`` (n elements), in rank order."""
    return _traced(name, input.nbytes, async_op, lambda: all_gather_single(output, input, group, async_op), input,
                   "all_gather")


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, name="reduce_scatter"):
    """Rank r's ``output`` (n elements) gets the sum over ranks of chunk r of ``input`` (world_size * n)."""
    return _traced(name, input.nbytes, async_op,
                   lambda: reduce_scatter_single(output, input, op, group, async_op), input, "reduce_scatter")


def broadcast(tensor, src, group=None, async_op=False, name="broadcast"):
    return _traced(name, tensor.nbytes, async_op, lambda: dist.broadcast(tensor, src, group, async_op), tensor,
                   "broadcast")


def all_to_all(output, input, group=None, async_op=False, name="all_to_all"):
    return _traced(name, input.nbytes, async_op,
                   lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op), input, "all_to_all")


def barrier(group=None, name="barrier"):
    with span(name, "comm", bytes=0, op="barrier"):
        dist.barrier(group)


def _p2p(call, op, tensor, peer, group, name, async_op, meta):
    default = f"send to {peer}" if op == "send" else f"recv from {peer}"
    return _traced(name or default, tensor.nbytes, async_op, lambda: call(tensor, peer, group), tensor, op,
                   peer=peer, **meta)


def send(tensor, dst, group=None, name=None, **meta):
    """``meta`` (e.g. ``step=2, chunk=3``) is kept on the span and in the Chrome trace."""
    return _p2p(dist.send, "send", tensor, dst, group, name, False, meta)


def recv(tensor, src, group=None, name=None, **meta):
    return _p2p(dist.recv, "recv", tensor, src, group, name, False, meta)


def isend(tensor, dst, group=None, name=None, **meta):
    return _p2p(dist.isend, "send", tensor, dst, group, name, True, meta)


def irecv(tensor, src, group=None, name=None, **meta):
    return _p2p(dist.irecv, "recv", tensor, src, group, name, True, meta)
