"""NCCL's point-to-point rules, held on Gloo: strict mode (lablib's sends and receives are in messages.py).

Under NCCL (NCCL's user guide, "Point-to-point communication" and "Group calls"; PyTorch's
``batch_isend_irecv``):

- a send may not complete until its matching receive has been posted;
- a rank's sends and receives on one communicator run one after the other, in the order issued;
- messages between two ranks match in the order issued: NCCL has no tags;
- a send and a receive that must both be in flight go as one group (``batch_isend_irecv``), which
  NCCL runs as one operation.

Gloo lets much more through (it buffers sends, matches by tag, progresses every operation at once), so
code that hangs on GPUs passes on a laptop. In strict mode lablib's sends, receives and exchanges on
Gloo obey NCCL's rules: each rank has one queue per group, which runs one operation at a time in issue
order; a send waits until the receive that matches it (the peer's next receive from this rank, in
order) has begun; a grouped exchange is one operation. Code that may deadlock under NCCL then
deadlocks here too, and the rank that waits says for whom and behind what, within the pool's timeout.

``CHECKS``: the checks (in the notebook and under ``lablib grade``) run exercise code in strict mode.
Elsewhere it is off (a message costs a few store round trips more in it: bench P13).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .pool.failures import NCCL_RULES

CHECKS = True
_BLOCKED_AFTER = 1.0  # seconds a rank waits before it publishes what it is blocked in, for its peers' reports


class _State:
    on = False
    epoch = 0       # the pool's job: keys of an earlier job are never read
    queues: dict = {}
    issued: dict = {}  # (group name, src, dst) -> messages issued so far


def job_started(job_id: int) -> None:
    """On a rank, before each job: fresh queues and counters (a failed job's are dropped with it)."""
    _State.on, _State.epoch, _State.queues, _State.issued = False, job_id, {}, {}


@contextmanager
def strict(on: bool = True):
    """Within the block, this rank's lablib point-to-point calls on Gloo obey NCCL's rules."""
    before, _State.on = _State.on, on
    try:
        yield
    finally:
        _State.on = before


def strictly(job):
    """``job`` run in strict mode, under its own name (what a check sends to the ranks)."""
    def run(*args, **kwargs):
        with strict():
            return job(*args, **kwargs)

    run.__name__ = getattr(job, "__name__", "job")
    return run


def active(group) -> bool:
    return _State.on and "nccl" not in str(dist.get_backend(group))


def _group_name(group) -> str:
    return getattr(group or dist.group.WORLD, "group_name", "world")


def _timeout() -> float:
    from .pool.groups import _State as pool

    if pool.timeout_s:
        return pool.timeout_s
    import torch.distributed.distributed_c10d as c10d

    return c10d.default_pg_timeout.total_seconds()


class _Op:
    """One operation of a rank's queue: sends and receives that run as one (one message, or a grouped
    exchange). ``texts``: what each message is called, for reports."""

    def __init__(self, sends, recvs, group, texts):
        self.group, self.texts = group, texts
        me, gname = dist.get_rank(), _group_name(group)
        prefix = f"lablib-p2p/{_State.epoch}/{gname}"
        def key(src, dst):
            n = _State.issued.get((gname, src, dst), 0)
            _State.issued[(gname, src, dst)] = n + 1
            return f"{prefix}/{src}>{dst}/{n}"
        self.sends = [(t, peer, key(me, peer)) for t, peer in sends]
        self.recvs = [(t, peer, key(peer, me)) for t, peer in recvs]
        self.me, self.blocked_key = me, f"lablib-p2p/{_State.epoch}/blocked/{me}"
        self.done, self.error = threading.Event(), None

    def describe(self) -> str:
        return " and ".join(f"'{t}'" for t in self.texts)

    def run(self, store) -> None:
        works = []
        for t, peer, k in self.recvs:  # the receives begin: the peers' sends may complete
            works.append(dist.irecv(t, peer, self.group))
            store.set(k + "/ready", b"1")
        for t, peer, k in self.sends:
            self._await(store, k + "/ready", peer, "send to")
            store.set(k + "/sent", b"1")
            works.append(dist.isend(t, peer, self.group))
        for _, peer, k in self.recvs:  # (waited for here, not in Gloo: a rank left waiting can say for what)
            self._await(store, k + "/sent", peer, "receive from")
        for w in works:
            w.wait()

    def _await(self, store, key, peer, doing) -> None:
        """Until ``key`` is set: polled (a store's own timed wait logs a warning each time it expires)."""
        start, pause, published = time.monotonic(), 20e-6, False
        deadline = start + 0.9 * _timeout()
        while not store.check([key]):
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
            if not published and time.monotonic() - start > _BLOCKED_AFTER:
                store.set(self.blocked_key, f"{self.describe()}, waiting to {doing} rank {peer}".encode())
                published = True
            if time.monotonic() > deadline:
                raise TimeoutError(self._report(store, peer, doing, time.monotonic() - start))
        if published:  # no longer blocked: a later report must not name this operation
            store.delete_key(self.blocked_key)

    def _report(self, store, peer, doing, waited) -> str:
        theirs = f"lablib-p2p/{_State.epoch}/blocked/{peer}"
        there = store.get(theirs).decode() if store.check([theirs]) else None
        what = "began the matching receive" if doing == "send to" else "sent that message"
        return (f"timed out after {waited:.0f} s {NCCL_RULES}: rank {self.me} waits to {doing} rank {peer} in "
                f"{self.describe()}, and rank {peer} never {what}: "
                + (f"rank {peer} is blocked in {there}. " if there else
                   f"rank {peer} is not blocked in a send or receive (it waits on something else: a handle, a "
                   "collective, a skipped step). ")
                + "Under NCCL a send completes only once its receive has begun, and each rank's sends and receives "
                "run one at a time in the order posted. Fix: post a send and a receive that must be in flight "
                "together as one lablib.exchange(sends=[...], recvs=[...]), or have one side receive first.")

    def wait(self, *args):
        self.done.wait()
        if self.error is not None:
            if not getattr(self.error, "lablib_op", None):  # what the report names it by (work.py: "isend")
                self.error.lablib_op = "exchange" if self.sends and self.recvs else "send" if self.sends else "recv"
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Queue:
    """A rank's point-to-point queue on one group: one thread that runs its operations in order."""

    def __init__(self, name):
        import queue

        import torch.distributed.distributed_c10d as c10d

        self.store, self.ops, self.failed = c10d._get_default_store(), queue.SimpleQueue(), None
        threading.Thread(target=self._loop, name=f"lablib-p2p {name}", daemon=True).start()

    def _loop(self):
        while True:
            op = self.ops.get()
            try:
                if self.failed is not None:
                    raise RuntimeError(f"not run: {self.failed.describe()} failed before it on this rank: "
                                       f"{type(self.failed.error).__name__}: {self.failed.error}")
                op.run(self.store)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the operation
                op.error, self.failed = exc, self.failed or op
            op.done.set()
            del op


def post(sends, recvs, group, texts) -> _Op:
    """Queue one operation (strict mode): the messages ``sends`` [(tensor, dst)] and ``recvs`` [(tensor, src)]
    as one. Returns its handle (``wait()``, ``is_completed()``)."""
    name = _group_name(group)
    q = _State.queues.get(name)
    if q is None:
        q = _State.queues[name] = _Queue(name)
    op = _Op(sends, recvs, group, texts)
    q.ops.put(op)
    return op


def prepare(group=None) -> None:
    """Under NCCL, the group's communicator made by a collective that every rank of the group runs here:
    ``batch_isend_irecv``'s first call on a group must have every rank of the group in it, which a pipeline's
    first exchange (a send on one stage, a receive on the next) is not. Nothing to do on Gloo."""
    if "nccl" in str(dist.get_backend(group)) and group not in _PREPARED:
        dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
        _PREPARED.add(group)


_PREPARED: set = set()


def forget() -> None:
    """The process group was destroyed (after a failed job): the groups ``prepare`` made NCCL's communicators
    for are gone, and the group made next (a new object, or ``None`` for the world again) needs its own."""
    _PREPARED.clear()


class Batch:
    """The messages of one ``lablib.exchange``, posted together once all are added: one queue operation in
    strict mode, one ``batch_isend_irecv`` under NCCL, the operations one by one on plain Gloo."""

    def __init__(self, group):
        self.group, self.parts, self.launched = group, [], threading.Event()

    def add(self, op: str, tensor, peer: int, text: str) -> "_Part":
        part = _Part(self, len(self.parts))
        self.parts.append((op, tensor, peer, text))
        return part

    def launch(self) -> None:
        sends = [(t, p) for op, t, p, _ in self.parts if op == "send"]
        recvs = [(t, p) for op, t, p, _ in self.parts if op == "recv"]
        if active(self.group):
            one = post(sends, recvs, self.group, [text for *_, text in self.parts])
            self.works = [one] * len(self.parts)
        elif "nccl" in str(dist.get_backend(self.group)) and self.parts[0][1].is_cuda:
            ops = [dist.P2POp(dist.isend if op == "send" else dist.irecv, t, p, self.group) for op, t, p, _ in self.parts]
            works = dist.batch_isend_irecv(ops)
            self.works = works if len(works) == len(ops) else [works[0]] * len(ops)
        else:
            self.works = [(dist.isend if op == "send" else dist.irecv)(t, p, self.group) for op, t, p, _ in self.parts]
        self.launched.set()


class _Part:
    """One message of a ``Batch``: its own handle, done when its work (in strict mode: the group's) is."""

    def __init__(self, batch, index):
        self._batch, self._index = batch, index

    def wait(self, *args):
        self._batch.launched.wait()
        return self._batch.works[self._index].wait(*args)

    def is_completed(self) -> bool:
        return self._batch.launched.is_set() and self._batch.works[self._index].is_completed()
