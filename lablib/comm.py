"""Traced collectives: the ``torch.distributed`` calls the labs use, each recorded as a comm span.

Same arguments as ``torch.distributed``; ``name=`` labels the span. Synchronous calls are timed from
call to return (on a GPU, ``lablib.gputime`` then places each span where its kernels ran);
``async_op=True`` calls return a ``Work`` whose span runs from issue to completion (seen by a callback
on the work's future, or for Gloo's sends and recvs, which have none, by a thread that waits on the
work; not by when ``wait()`` was called).

``bytes`` on a span is the tensor this rank contributes (for an all-gather, its input: nccl-tests'
"size" is the whole output); what crosses the wire depends on the algorithm and is the subject of
lab 02. ``bytes_sent`` models that traffic for the ring algorithms; on Gloo each synchronous span
also carries ``wire``, the bytes this rank really wrote to its sockets during the call (the
kernel's count, /proc/self/io), and ``bytes_on_wire`` adds those up.

``simulated(link)`` runs the traced collectives on this rank over a simulated interconnect: the real
collective still moves the data (results stay real), at once and off the clock (the rank's span clock
pauses while it runs), and the span lasts what the link would take under lab 02's α-β model, from the
moment the last rank issued it; a link carries one collective at a time (point-to-point messages
keep their real time). Compute stays real and measured. On a CPU, where Gloo's copies compete with
compute for the same cores, this shows the ideal case: a link that moves data at no cost to the
compute. (On a GPU, NCCL runs each collective as a kernel on some of the GPU's SMs, beside the compute
kernels: the overlap is real, but communication takes SMs and memory bandwidth from compute.)
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import flight
from .device_audit import check_collective
from .arguments import p_times, tensors
from .splits import row_bytes, same_splits, splits
from .traffic import BUS_FACTOR, bytes_on_wire, bytes_sent, ring_steps, written  # noqa: F401 (comm.bytes_sent, ...)
from .device_audit import enabled as _audited
from .timeline import CLOCK, RECORDER, AsyncSpan, RawSpan, _now, span
from .work import Work, _CopyOut, _GlooAsyncReduceScatter, _sleep_until, copy_back, message_over_link, \
    storage_short

# torch.distributed's own tensor-in/tensor-out collectives, untraced (for references, checks and timing
# loops). PyTorch 2.13 renamed them and warns on the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def device() -> torch.device:
    """The device this rank computes on (``lablib.device()``): the GPU its pool gave it (its own under
    NCCL, a shared one when there are fewer GPUs than ranks; ``lablib.cluster(device=...)`` decides, and
    under torchrun ``lablib.run``), else the CPU. Outside a pool, its GPU under an NCCL process group."""
    kind = os.environ.get("LABLIB_DEVICE")
    if kind is None and dist.is_initialized() and torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        kind = "cuda"
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def torch_device() -> torch.device:
    """Where PyTorch's own parallel APIs (FSDP2, DTensor, ``torch.distributed.pipelining``) run when a lab
    compares with them: this rank's GPU under NCCL; the CPU under Gloo, which does not take CUDA tensors for
    every collective they use (send/recv, reduce-scatter)."""
    return device() if dist.is_initialized() and not _on_gloo(None) else torch.device("cpu")


def synchronize() -> None:
    """Wait for this rank's GPU (nothing to wait for on the CPU): before a clock reads the end of GPU work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def to_device(*tensors):
    """``tensors`` moved to this rank's device (one tensor back for one given): what a rank job does with
    the models and data it built on the CPU from a seed, so every device starts from the same numbers."""
    dev = device()
    moved = [t.to(dev) for t in tensors]
    return moved[0] if len(moved) == 1 else moved


# -- a simulated link ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """An interconnect under the α-β model: α seconds per message step, β bytes per second per rank."""
    name: str
    alpha: float
    beta: float
    source: str = ""

    def seconds(self, op: str, nbytes: int, n: int) -> float:
        """The ring algorithm's time for ``op`` when this rank contributes ``nbytes`` (lab 02's model:
        ring steps × α + bytes each rank sends / β)."""
        full = nbytes * (n if op == "all_gather" else 1)
        return ring_steps(op, n) * self.alpha + BUS_FACTOR.get(op, lambda n: 1.0)(n) * full / self.beta

    def __str__(self):
        return (f"{self.name}: α = {self.alpha * 1e6:.0f} µs, β = {self.beta / 1e9:.3g} GB/s"
                + (f" ({self.source})" if self.source else ""))


# Stated figures, for simulated links. Ethernet: the line rate / 8; α: a typical small-message latency
# through a kernel TCP stack.
LINKS = {
    "1GbE": Link("1 Gb/s Ethernet", 50e-6, 0.125e9, "datasheet line rate, typical TCP latency"),
    "2.5GbE": Link("2.5 Gb/s Ethernet", 25e-6, 0.3125e9, "datasheet line rate, typical TCP latency"),
    "10GbE": Link("10 Gb/s Ethernet", 25e-6, 1.25e9, "datasheet line rate, typical TCP latency"),
    "25GbE": Link("25 Gb/s Ethernet", 15e-6, 3.125e9, "datasheet line rate, typical TCP latency"),
}


class _Simulation:
    link: Link | None = None
    free = 0  # when the link finishes what it carries now (span clock, ns)
    sends = [0]  # when this rank's outgoing link finishes its messages in flight (ns)


_SIM = _Simulation()


@contextmanager
def simulated(link: Link | None):
    """Within the block, this rank's traced collectives, sends and receives run over ``link`` (None: the
    real one). Every rank must enter it together (after a barrier): the ranks' span clocks restart in step."""
    before = _SIM.link
    _SIM.link, _SIM.free, _SIM.sends = link, 0, [0]
    restart_clock()
    try:
        yield link
    finally:
        _SIM.link = before
        restart_clock()


def restart_clock() -> None:
    """Undo the paused time; call on every rank right after a barrier, so the span clocks agree again."""
    CLOCK.set_paused(0)


def _over_link(link, name, nbytes, async_op, call, op, meta, target, back=None, group=None):
    issued = _now()
    real = time.perf_counter_ns()
    work = call()
    if async_op:
        work.wait()
    last = torch.tensor([issued], dtype=torch.int64, device="cpu")  # Gloo's side of the group, under NCCL too
    dist.all_reduce(last, dist.ReduceOp.MAX, group=group)  # the link starts when the group's last rank has issued
    CLOCK.set_paused(CLOCK.paused + time.perf_counter_ns() - real)
    start = max(int(last.item()), _SIM.free)
    end = _SIM.free = start + round(link.seconds(op, nbytes, dist.get_world_size(group)) * 1e9)
    meta = {**meta, "op": op, "simulated": link.name}
    if async_op:
        trace = AsyncSpan(name, "comm", nbytes, **meta)
        trace.t0 = issued
        return Work(work, trace, end, target, back)
    _sleep_until(end)
    if RECORDER.spans is not None:
        RECORDER.spans.append(RawSpan(name, "comm", issued, end, RECORDER.depth, nbytes, False, meta))
    return None


# (op, the tensor written into, bytes in, the peer of a send or recv, an all-to-all's bytes to each rank) of each traced call issued while a list is here
WATCH: list = [None]
WORKS: list = [None]


def watched(fn, *args, works: list | None = None, peers: bool = False, groups: bool = False):
    """``fn(*args)`` and the traced collectives it issued, in order: "all_reduce 3072" (its name and the
    bytes it took in). ``works``: a list that receives the handle of each one issued with ``async_op``
    (``Work.waited`` then tells whether ``fn`` waited for it). ``peers``: a send or recv as "send 512 to 1", an
    all-to-all with the bytes it sent to each rank, "all_to_all 96 to 32/64". ``groups``: a collective with the
    ranks of its group, "all_reduce 3072 on 0/2" ("on all" without a group)."""
    WATCH[0], WORKS[0] = [], works
    try:
        out = fn(*args)
        return out, [f"{op} {nbytes}" + (f" {'to' if op != 'recv' else 'from'} {_peer(peer)}" if peers and peer is not None else "")
                     + (f" on {_peer(group) if group else 'all'}" if groups and op not in ("send", "recv") else "")
                     for op, _, nbytes, peer, group in WATCH[0]]
    finally:
        WATCH[0] = WORKS[0] = None


def op_bytes(ops) -> dict[str, int]:
    """``watched``'s list ("all_reduce 3072", ...) as the bytes each kind of call took in, summed."""
    out: dict[str, int] = {}
    for op in ops:
        kind, nbytes = op.split()[:2]
        out[kind] = out.get(kind, 0) + int(nbytes)
    return out


def _peer(peer) -> str:
    return "/".join(map(str, peer)) if isinstance(peer, (list, tuple)) else str(peer)


STAGE_CPU = [False]  # stage CPU tensors through host copies too: the staging path, tested without a GPU


def _on_gloo(group) -> bool:
    return "nccl" not in str(dist.get_backend(group))


def _host_copy(t, read: bool):
    """A pinned host tensor like ``t`` (its values copied in if ``read``), for Gloo."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    if read:
        with span("copy to host", "comm", bytes=t.nbytes, op="memcpy"):
            host.copy_(t)
    return host


def _staged(op, tensor, target):
    """CUDA tensors for Gloo, which takes host memory (its send/recv do not stage CUDA tensors at all): host
    copies of the tensors and the (host, GPU) pairs to copy back once the collective completed. The copies
    are spans of their own ("copy to host", "copy from host"), so the timeline shows what staging costs. A
    tensor whose storage was freed fails as Gloo fails it on the CPU ("... storage of size 0"), not in a copy."""
    for t, what in ((tensor, "output" if op == "recv" else "input"), (target, "output")):
        short = t is not None and storage_short(t)
        if short:
            raise RuntimeError(f"lablib.{op}: the {what} needs {short[0]} bytes of storage, out of bounds for storage "
                               f"of size {short[1]} (freed, or resized smaller, before the call)")
    if target is not None:  # out of place: input copied in, output copied back
        out = _host_copy(target, False)
        return _host_copy(tensor, True), out, [(out, target)]
    host = _host_copy(tensor, op != "recv")
    return host, None, [] if op == "send" else [(host, tensor)]


def _traced(name, nbytes, async_op, call, tensor, op, target=None, group=None, stamp=None, **meta):
    """``call(tensor, target)`` traced as one comm span (or a ``Work`` when ``async_op``)."""
    if _audited():
        check_collective(tensor, op)
        if target is not None:
            check_collective(target, op)
    if group is not None and op not in ("send", "recv"):  # a sub-group's collective: its ranks, for the byte counts
        meta["group"] = dist.get_process_group_ranks(group)
    if WATCH[0] is not None:
        WATCH[0].append((op, target, nbytes, meta.get("peer", meta.get("to")), meta.get("group")))
    flight.record(op, tensor, nbytes, meta.get("group"), meta.get("peer"))
    back, device_target = None, target
    if (tensor.is_cuda or STAGE_CPU[0]) and _on_gloo(group):
        tensor, target, back = _staged(op, tensor, target)
    if _SIM.link is not None and op in ("send", "recv"):
        return message_over_link(_SIM.link, name, nbytes, async_op, call, stamp, tensor, op, meta, back, _SIM.sends)
    if _SIM.link is not None:
        out = _over_link(_SIM.link, name, nbytes, async_op, lambda: call(tensor, target), op, meta, device_target, back,
                         group)
        if back and not async_op:
            copy_back(back)
        return out
    if async_op:  # the span opens before the call: a message's bar starts when it was posted
        trace = AsyncSpan(name, "comm", nbytes, op=op, **meta)
        work = Work(call(tensor, target), trace, target=device_target, back=back)
        if WORKS[0] is not None:
            WORKS[0].append(work)
        return work
    with span(name, "comm", bytes=nbytes, op=op, **meta) as s:
        # Only while recording: a timing loop (bandwidth.sweep) must not pay two /proc reads a message.
        before = written() if RECORDER.spans is not None and not tensor.is_cuda else None
        out = call(tensor, target)  # NCCL returns at enqueue: gputime places the span where its kernel ran
        if before is not None:
            s.meta["wire"] = written() - before
    if back:
        copy_back(back)
    return out


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, name="all_reduce"):
    tensors("all_reduce", tensor=tensor)
    return _traced(name, tensor.nbytes, async_op, lambda t, _: dist.all_reduce(t, op, group, async_op), tensor,
                   "all_reduce", group=group)


def all_gather(output, input, group=None, async_op=False, name="all_gather"):
    """``output`` (world_size * n elements) receives every rank's ``input`` (n elements), in rank order.
    With ``async_op=True`` on a CPU, ``output`` is filled by ``wait()``."""
    tensors("all_gather", output=output, input=input)
    p_times("all_gather", output, input, dist.get_world_size(group))
    def call(input, output):
        if async_op and not output.is_cuda:
            return _CopyOut(output, lambda buffer: all_gather_single(buffer, input, group, True))
        return all_gather_single(output, input, group, async_op)

    return _traced(name, input.nbytes, async_op, call, input, "all_gather", target=output, group=group)


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, name="reduce_scatter"):
    """Rank r's ``output`` (n elements) gets the sum over ranks of chunk r of ``input`` (world_size * n)."""
    tensors("reduce_scatter", output=output, input=input)
    p_times("reduce_scatter", output, input, dist.get_world_size(group))
    def call(input, output):
        if async_op and not input.is_cuda and _on_gloo(group):
            return _GlooAsyncReduceScatter(output, input, op, group)
        return reduce_scatter_single(output, input, op, group, async_op)

    return _traced(name, input.nbytes, async_op, call, input, "reduce_scatter", target=output, group=group)


def broadcast(tensor, src, group=None, async_op=False, name="broadcast"):
    tensors("broadcast", tensor=tensor)
    return _traced(name, tensor.nbytes, async_op, lambda t, _: dist.broadcast(t, src, group, async_op), tensor,
                   "broadcast", group=group)


def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
               name="all_to_all"):
    """Rank r sends rows ``input_split_sizes[j]`` of ``input`` (cut along dim 0, in order) to rank j, and
    receives rank j's rows into the next ``output_split_sizes[j]`` rows of ``output``. Without split sizes
    the cuts are equal. The receiver's ``output_split_sizes[j]`` must be what rank j sends it (its
    ``input_split_sizes[r]``), so uneven splits are exchanged first; a mismatch is a ValueError that names
    both, where Gloo would abort the rank. The span keeps the bytes sent to (``to``) and received from
    (``from``) each rank."""
    tensors("all_to_all", output=output, input=input)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    ins, outs = (splits(s, t, n, side) for s, t, side in ((input_split_sizes, input, "input"),
                                                          (output_split_sizes, output, "output")))
    uneven = input_split_sizes is not None or output_split_sizes is not None
    on = input.device if not _on_gloo(group) else torch.device("cpu")

    def call(i, o):  # the split sizes are checked inside the span: a rank waiting for a slow peer waits in it
        if uneven:
            same_splits(ins, outs, me, on, group)
        return dist.all_to_all_single(o, i, outs, ins, group=group, async_op=async_op)

    to, got = [c * row_bytes(input) for c in ins], [c * row_bytes(output) for c in outs]
    return _traced(name, input.nbytes, async_op, call, input, "all_to_all", target=output, group=group, to=to,
                   **{"from": got})


def barrier(group=None, name="barrier"):
    with span(name, "comm", bytes=0, op="barrier"):
        dist.barrier(group)
