"""Point-to-point messages, traced: ``send``, ``recv``, ``isend``, ``irecv``, and ``exchange``, which posts
sends and receives that must be in flight together as one (under NCCL one ``batch_isend_irecv``). In strict
mode (``p2p.py``, on in every check) they obey NCCL's rules on Gloo too. Messages between two ranks match in
the order posted: there are no tags, as NCCL has none."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import p2p
from .arguments import tensors
from .comm import _traced


def _p2p(call, op, tensor, peer, group, name, async_op, meta, batch=None):
    tensors(("i" if async_op else "") + op, tensor=tensor)
    n, me = dist.get_world_size(), dist.get_rank()
    called = f"lablib.{'i' if async_op else ''}{op} {'to' if op == 'send' else 'from'} rank {peer}"
    if not 0 <= peer < n:  # Gloo would wait for a rank that never joins, then fail with a store timeout
        raise ValueError(f"{called}, but the world has {n} ranks (0 to {n - 1}): to wrap around, take the peer % "
                         f"world_size, e.g. (rank + 1) % {n}")
    if peer == me:  # nothing would ever match it
        raise ValueError(f"{called}: that is this rank itself; a message goes to another rank")
    if "tag" in meta:
        raise ValueError(f"{called} with tag=: lablib's messages have no tags, as NCCL's have none. Messages between "
                         "two ranks match in the order they were posted: receive them in the order they are sent.")
    name = name or (f"send to {peer}" if op == "send" else f"recv from {peer}")
    if batch is not None:  # a message of lablib.exchange: posted with the others
        def call(t, peer, group):
            return batch.add(op, t, peer, name)
    elif p2p.active(group):  # strict mode: NCCL's rules (lablib.p2p)
        def call(t, peer, group):
            one = p2p.post([(t, peer)] if op == "send" else [], [(t, peer)] if op == "recv" else [], group, [name])
            return one if async_op else one.wait()
    stamp = dist.isend if op == "send" else dist.irecv  # a simulated message's arrival time (Gloo, host memory)
    return _traced(name, tensor.nbytes, async_op, lambda t, _: call(t, peer, group), tensor, op, group=group,
                   stamp=lambda t: stamp(t, peer, group, _STAMP_TAG), peer=peer, **meta)


_STAMP_TAG = 1 << 30  # Gloo only: NCCL's point-to-point has no tags


def send(tensor, dst, group=None, name=None, **meta):
    """A blocking send: returns once ``dst`` has the message (on Gloo: once it left; under NCCL a send
    completes only once ``dst`` has begun the receive). ``meta`` (e.g. ``step=2, chunk=3``) is kept on the
    span and in the Chrome trace. Messages between two ranks match in the order posted (no tags)."""
    return _p2p(dist.send, "send", tensor, dst, group, name, False, meta)


def recv(tensor, src, group=None, name=None, **meta):
    return _p2p(dist.recv, "recv", tensor, src, group, name, False, meta)


def isend(tensor, dst, group=None, name=None, **meta):
    return _p2p(dist.isend, "send", tensor, dst, group, name, True, meta)


def irecv(tensor, src, group=None, name=None, **meta):
    return _p2p(dist.irecv, "recv", tensor, src, group, name, True, meta)


class Exchange:
    """The handle of ``exchange``: ``wait()`` waits for every message; ``works`` holds one per message."""

    def __init__(self, works):
        self.works = works

    def wait(self, *args):
        for work in self.works:
            work.wait(*args)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def exchange(sends=(), recvs=(), group=None, name=None, **meta) -> Exchange:
    """Sends and receives that must be in flight together, posted as one: ``sends`` [(tensor, dst)],
    ``recvs`` [(tensor, src)] (a third item names a message's span, ``(y, dst, "send F3")``, or is a dict of what
    its span keeps, ``(y, dst, {"chunk": 2})``). Returns one handle; wait on it before reading a received
    tensor or writing a sent one. Under NCCL this is one
    ``batch_isend_irecv`` (NCCL runs a rank's sends and receives one at a time, in the order posted, and a
    send completes only once its receive has begun: a send and a receive posted apart can deadlock, grouped
    they cannot); on Gloo the messages are posted one by one, receives first. Each message is a span of its
    own: "``name``: send" and "``name``: recv", or named after its peer."""
    for what, given in {"sends": sends, "recvs": recvs}.items():
        if not isinstance(given, (list, tuple)) or not all(
                isinstance(x, (list, tuple)) and len(x) in (2, 3) and isinstance(x[0], torch.Tensor)
                and isinstance(x[1], int) and not isinstance(x[1], bool) for x in given):
            raise TypeError(f"lablib.exchange({what}=...) takes a list of (tensor, rank) pairs, e.g. {what}="
                            f"[(buffer, {'right' if what == 'sends' else 'left'})]; got {given!r:.80}")
    if not sends and not recvs:
        raise ValueError("lablib.exchange() got no sends and no recvs: give it the messages to post together")
    batch = p2p.Batch(group)
    works = []
    for op, given in (("recv", recvs), ("send", sends)):
        for x in given:
            own = x[2] if len(x) == 3 and isinstance(x[2], dict) else {}
            called = x[2] if len(x) == 3 and isinstance(x[2], str) else name and f"{name}: {op}"
            works.append(_p2p(None, op, x[0], x[1], group, called, True, {**meta, **own}, batch))
    batch.launch()
    return Exchange(works)
