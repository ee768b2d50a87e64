"""Each rank's flight recorder: the last lablib collectives and messages it issued in the current job, kept
so that a hang's report can say what every rank last did (PyTorch's own Flight Recorder keeps the same for
NCCL, ``TORCH_NCCL_TRACE_BUFFER_SIZE``).

An entry is plain data, ``(seq, op, nbytes, dtype, shape, group, peer)``: ``seq`` counts this rank's calls in
the job from 1, ``group`` the ranks of a sub-group's collective (None: every rank), ``peer`` a message's other
rank. ``RankError.flight`` returns them per rank.

A pool's rank also writes each entry into a small file of its pool's (``LABLIB_FLIGHT``, one slot per entry,
mapped into memory), which the parent reads when a job fails: so the record of a rank that finished, or
that Gloo aborted for a mismatched collective, or that was killed, is read as well as a stuck one's.
"""
from __future__ import annotations

import ast
import mmap
import os
from collections import deque

SIZE = 32  # entries kept per rank
SLOT = 256  # bytes per entry in the file: 2 of length, then the entry's repr (read back as a literal)
_RING: deque = deque(maxlen=SIZE)
_SEQ = [0]
_FILE: list = []  # [mmap] on a pool's rank


def _mapped():
    if not _FILE:
        path = os.environ.get("LABLIB_FLIGHT")
        if not path:
            _FILE.append(None)
        else:
            with open(path, "w+b") as f:
                f.truncate(SIZE * SLOT)
                _FILE.append(mmap.mmap(f.fileno(), SIZE * SLOT))
    return _FILE[0]


def started() -> None:
    """On a rank, before each job: an empty record."""
    _RING.clear()
    _SEQ[0] = 0
    m = _mapped()
    if m is not None:
        m[:] = bytes(SIZE * SLOT)


def record(op: str, tensor, nbytes: int, group=None, peer=None) -> None:
    """One call, kept in the rank's file if it has one (a pool's rank), else in memory (under torchrun)."""
    _SEQ[0] += 1
    entry = (_SEQ[0], op, int(nbytes), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
             tuple(group) if group else None, peer if peer is None or isinstance(peer, int) else tuple(peer))
    m = _mapped()
    if m is None:
        _RING.append(entry)
        return
    data = repr(entry).encode()
    if len(data) <= SLOT - 2:
        at = (entry[0] - 1) % SIZE * SLOT
        m[at + 2:at + 2 + len(data)] = data
        m[at:at + 2] = len(data).to_bytes(2, "little")


def entries() -> tuple:
    """This rank's entries of the job so far, oldest first."""
    m = _mapped()
    return tuple(_RING) if m is None else _parse(m[:])


def file(folder: str, rank: int) -> str:
    """Where a pool's rank ``rank`` writes its entries (the pool's own folder)."""
    return os.path.join(folder, f"flight-{rank}")


def read_all(folder: str, world_size: int) -> dict:
    """In the parent, once a job failed (before a killed rank's restart empties its file): {rank: entries}."""
    return {r: read(file(folder, r)) for r in range(world_size)}


def read(path) -> tuple:
    """In the parent: the entries a rank's file holds, oldest first (() when it holds none)."""
    try:
        with open(path, "rb") as f:
            return _parse(f.read(SIZE * SLOT))
    except OSError:
        return ()


def _parse(raw: bytes) -> tuple:
    got = []
    for at in range(0, len(raw) - SLOT + 1, SLOT):
        size = int.from_bytes(raw[at:at + 2], "little")
        if 0 < size <= SLOT - 2:
            try:
                entry = ast.literal_eval(raw[at + 2:at + 2 + size].decode())
            except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
                continue  # a slot the rank was writing when it died
            if isinstance(entry, tuple) and len(entry) == 7 and isinstance(entry[0], int):
                got.append(entry)
    return tuple(sorted(got, key=lambda e: e[0]))


def line(entry) -> str:
    """One entry as a report shows it: "#4 all_gather 64 B (float32 (16,))", "#7 send 16 B to 1"."""
    seq, op, nbytes, dtype, shape, group, peer = entry
    where = f" on {'/'.join(map(str, group))}" if group else ""
    to = "" if peer is None else f" {'from' if op in ('recv', 'irecv') else 'to'} {peer}"
    return f"#{seq} {op} {nbytes} B ({dtype} {shape}){where}{to}"
