"""Handles of asynchronous collectives and messages, whose spans close when their work completes.

``Work`` wraps a ``torch.distributed`` work handle for ``lablib.comm``: its span closes on the work's
future, or, for Gloo's sends and recvs, which have none, when a watcher thread sees the work complete.
``_CopyOut`` and ``_GlooAsyncReduceScatter`` are the two asynchronous collectives Gloo does not run the way
the labs need (an all-gather into a buffer that may be freed; a reduce-scatter that would not start
before ``wait()``).
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from .timeline import RECORDER, AsyncSpan, RawSpan, _now, span


class Work:
    """Wraps a ``torch.distributed`` work handle so its span closes when the work completes (under a
    simulated link: at ``end``, ns on the span clock), not when ``wait()`` happens to be called.
    ``waited``: whether ``wait()`` was called.

    Gloo's send and recv works have no future: a watcher thread waits on them instead (``_WATCHER``),
    so a message's bar ends when it was delivered even if the program waits for its handle much later
    (lab 05's executor waits for its sends at the end of the step). ``wait()`` then waits for the
    watcher, and ``done_at`` says when the work completed (ns on the span clock)."""

    def __init__(self, work, trace: AsyncSpan, end: int | None = None, target=None, back=None):
        self._work, self._span, self._end, self._target = work, trace, end, target
        self._back = back  # (host, GPU) tensors to copy once done: a CUDA collective staged for Gloo
        self._waited, self._done, self._error, self.done_at = False, None, None, None
        if end is None:
            try:
                work.get_future().add_done_callback(self._complete)
            except (RuntimeError, AttributeError):  # Gloo's send/recv works have no future
                self._done = threading.Event()
                _WATCHER.watch(work, self._watched)

    def _complete(self, *_):
        self.done_at = _now()
        self._span.close(at=self.done_at)

    def _watched(self, error):
        self._error = error
        self._complete()
        self._done.set()

    @property
    def op(self) -> str | None:
        return self._span.meta.get("op")

    @property
    def nbytes(self) -> int | None:
        """The bytes this rank contributes (as on its span)."""
        return self._span.bytes

    @property
    def waited(self) -> bool:
        return self._waited

    @property
    def target(self):
        """The tensor the collective writes into."""
        return self._target

    def wait(self, *args):
        if self._end is not None:  # the link would still be busy until _end (a message's: when it arrives)
            if isinstance(self._work, _Message):  # a collective's work completed before its Work was made
                self._work.wait()
            end = self._end() if callable(self._end) else self._end
            _sleep_until(end)
            self._span.close(at=end)
            self._finish()
            return True
        if self._done is not None:
            timeout = args[0] if args else None
            if not self._done.wait(timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout):
                raise RuntimeError(f"{self._span.name}: not completed within {timeout}")
            if self._error is not None:  # raised in the watcher's thread: say which operation it was
                self._error.lablib_op = f"i{self.op}" if self.op in ("send", "recv") else self.op
                raise self._error
            out = True
        else:
            out = self._work.wait(*args)
        self._span.close()  # a no-op where the completion closed it already
        self._finish()
        return out

    def _finish(self):
        if self._back and not self._waited:
            copy_back(self._back)
        self._waited = True

    def is_completed(self):
        """Whether the work completed. Once it says so, the work counts as waited for (its data is in
        place: copied back, its error raised). Nothing else of the raw handle is passed on: its future
        or its own wait would complete the work behind ``waited``, which the checks judge."""
        if self._end is not None:
            done = (not isinstance(self._work, _Message) or self._work.is_completed()) and \
                _now() >= (self._end() if callable(self._end) else self._end)
        else:
            done = self._done.is_set() if self._done is not None else self._work.is_completed()
        if done:
            self.wait()
        return done


class _Message:
    """A message under a simulated link: its data and the time it arrives (the sender's clock, which the
    ranks of one machine share), sent to the same peer on a tag of its own."""

    def __init__(self, works, stamp):
        self._works, self._stamp = [w for w in works if hasattr(w, "wait")], stamp  # a blocking call returns no work

    def wait(self, *args):
        while self._works:  # each once: waiting again on a completed Gloo recv waits for another message
            self._works[0].wait()
            self._works.pop(0)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def arrival(self) -> int:
        self.wait()
        return int(self._stamp.item())


def message_over_link(link, name, nbytes, async_op, call, stamp_call, tensor, op, meta, back, free: list):
    """A send or recv over a simulated ``link`` (lablib.comm.simulated): the data moves for real; the send
    takes α + bytes/β on this rank's outgoing link (``free[0]``: when that is free, ns) and ends when the
    message arrives; the recv ends at that arrival, or when it is posted if the message came before."""
    issued = _now()
    stamp = torch.zeros(1, dtype=torch.int64)  # on the host: Gloo carries it, under NCCL too
    end = None
    if op == "send":
        start = max(issued, free[0])
        end = free[0] = start + round((link.alpha + nbytes / link.beta) * 1e9)
        stamp.fill_(end)
    message = _Message([call(tensor, None), stamp_call(stamp)], stamp)
    meta = {**meta, "op": op, "simulated": link.name}
    if async_op:
        trace = AsyncSpan(name, "comm", nbytes, **meta)
        trace.t0 = issued
        return Work(message, trace, end if end is not None else (lambda: max(issued, message.arrival())), back=back)
    end = end if end is not None else max(issued, message.arrival())
    message.wait()
    _sleep_until(end)
    if RECORDER.spans is not None:
        RECORDER.spans.append(RawSpan(name, "comm", issued, end, RECORDER.depth, nbytes, False, meta))
    if back:
        copy_back(back)
    return None


def storage_short(t) -> tuple[int, int] | None:
    """(bytes ``t`` reaches into its storage, bytes the storage holds) when the storage is too small for it (a
    unit's flat buffer freed by reshard), else None."""
    if t.numel() == 0:
        return None
    need = (t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    have = t.untyped_storage().nbytes()
    return (need, have) if have < need else None


def lost_output(short) -> RuntimeError:
    need, have = short
    return RuntimeError(f"an asynchronous collective lost its output: the output's storage was freed ({have} bytes "
                        f"left of {need}) while the collective was in flight. Wait for a unit's gather before "
                        "freeing it.")


def copy_back(pairs) -> None:
    """After a collective staged through host memory (CUDA tensors on Gloo): each host result copied into
    its GPU tensor, as a span of its own. A GPU tensor whose storage was freed meanwhile is named, as
    ``_CopyOut`` names it on the CPU, instead of failing in the copy."""
    for host, dev in pairs:
        short = storage_short(dev)
        if short:
            raise lost_output(short)
        with span("copy from host", "comm", bytes=host.nbytes, op="memcpy"):
            dev.copy_(host)


class _Watcher:
    """Threads that wait on works without a future and report when each completed. A thread for each
    work in flight (idle ones are reused), so no message's completion is seen late because another,
    undelivered one holds the thread."""

    def __init__(self):
        self._lock, self._idle, self._queue = threading.Lock(), 0, queue.SimpleQueue()

    def watch(self, work, done) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._loop, name="lablib-work-watcher", daemon=True).start()
        self._queue.put((work, done))

    def _loop(self):
        while True:
            work, done = self._queue.get()
            try:
                work.wait()
                error = None
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the handle
                error = exc
            done(error)
            del work, done
            with self._lock:
                self._idle += 1


_WATCHER = _Watcher()


def _sleep_until(t: int) -> None:
    left = t - _now()
    if left > 0:
        time.sleep(left / 1e9)


class _CopyOut:
    """An asynchronous all-gather into a buffer of its own, copied into ``output`` by ``wait()`` (as FSDP2
    copies out of its all-gather buffer). Gloo writes into the buffer from its own threads; had it
    written into ``output`` directly, freeing ``output``'s storage while the gather was in flight (an
    easy mistake when prefetching) would let it write into freed memory and crash the rank."""

    def __init__(self, output, start):
        self._output, self._buffer = output, torch.empty(output.shape, dtype=output.dtype, device=output.device)
        self._work = start(self._buffer)

    def wait(self, *args):
        self._work.wait(*args)
        short = storage_short(self._output)
        if short:
            raise lost_output(short)
        self._output.copy_(self._buffer)
        return True

    def is_completed(self):
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


class _GlooAsyncReduceScatter:
    """Gloo runs an asynchronous reduce-scatter only once it is waited for (PyTorch 2.13: the work does
    not progress before ``wait()``), so nothing could overlap it. Gloo builds its reduce-scatter from an
    all-reduce anyway; this issues that all-reduce (on a copy), which Gloo does run in the background,
    and copies this rank's chunk out when it completes: the same bytes on the wire, truly async."""

    def __init__(self, output, input, op, group):
        rank = dist.get_rank(group)
        buffer = input.detach().clone()
        self._work = dist.all_reduce(buffer, op, group, async_op=True)
        chunk = buffer.view(-1)[rank * output.numel():(rank + 1) * output.numel()]
        self._future = self._work.get_future().then(lambda _: output.view(-1).copy_(chunk))

    def wait(self, *args):
        self._work.wait(*args)
        self._future.wait()
        return True

    def is_completed(self):
        return self._future.done()

    def get_future(self):
        return self._future
