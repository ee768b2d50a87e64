"""Each rank's flight recorder: the last lablib collectives and messages it issued in the current job, kept
so that a hang's report can say what every rank last did (PyTorch's own Flight Recorder keeps the same for
NCCL, ``TORCH_NCCL_TRACE_BUFFER_SIZE``).

An entry is plain data, ``(seq, op, nbytes, dtype, shape, group, peer)``: ``seq`` counts this rank's calls in
the job from 1, ``group`` the ranks of a sub-group's collective (None: every rank), ``peer`` a message's other
rank. ``RankError.flight`` returns them per rank.
"""
from __future__ import annotations

from collections import deque

SIZE = 32  # entries kept per rank
_RING: deque = deque(maxlen=SIZE)
_SEQ = [0]


def started() -> None:
    """On a rank, before each job: an empty record."""
    _RING.clear()
    _SEQ[0] = 0


def record(op: str, tensor, nbytes: int, group=None, peer=None) -> None:
    _SEQ[0] += 1
    _RING.append((_SEQ[0], op, int(nbytes), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                  tuple(group) if group else None, peer if peer is None or isinstance(peer, int) else tuple(peer)))


def entries() -> tuple:
    return tuple(_RING)


def line(entry) -> str:
    """One entry as a report shows it: "#4 all_gather 64 B (float32 (16,))", "#7 send 16 B to 1"."""
    seq, op, nbytes, dtype, shape, group, peer = entry
    where = f" on {'/'.join(map(str, group))}" if group else ""
    to = "" if peer is None else f" {'from' if op in ('recv', 'irecv') else 'to'} {peer}"
    return f"#{seq} {op} {nbytes} B ({dtype} {shape}){where}{to}"
