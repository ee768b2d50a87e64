"""What the notebook (parent) and its ranks say to each other, and how objects travel between them.

Messages are named tuples, pickled, over an authenticated ``multiprocessing.connection`` socket:

  parent -> rank:  Ping | Job | Exit
  rank -> parent:  Hello | Pong | Out | Done

Python-level prints travel on the same socket as the result, so a rank's output always reaches the
cell before its result does. C-level output (Gloo, c10d) goes to the rank's stdout/stderr pipes,
which the parent also reads.

Functions, arguments and results travel inside messages as bytes made by ``ship``: cloudpickle, by
value for anything defined in the notebook (a notebook's ``__main__`` can't be imported by a rank),
with two changes:
- code objects keep their file name (cloudpickle 3 replaces it with "<dynamic-code>"), so a rank's
  traceback can quote the notebook cell it came from;
- with ``to_cpu``, tensors come home on the CPU whatever device they were on: the notebook kernel
  should not have to initialise CUDA to read them.
"""
from __future__ import annotations

import io
import pickle
import time
import types
from collections import ChainMap
from dataclasses import dataclass
from typing import NamedTuple

import cloudpickle


# -- parent -> rank --------------------------------------------------------------------------------
class Ping(NamedTuple):
    """Clock alignment: the rank answers with a Pong carrying its clock."""


class Job(NamedTuple):
    job_id: int
    gen: int            # process-group generation: a new one means "re-create the group"
    debug: bool         # TORCH_DISTRIBUTED_DEBUG=DETAIL for this generation
    payload: bytes      # ship((fn, args, kwargs))
    sources: dict       # {filename: lines} of notebook cells, so tracebacks can quote them


class Exit(NamedTuple):
    pass


# -- rank -> parent --------------------------------------------------------------------------------
class Hello(NamedTuple):
    rank: int
    pid: int


class Pong(NamedTuple):
    t_ns: int           # the rank's perf_counter_ns when it answered


def clock_offset(conn, pings: int = 5) -> tuple[int, int]:
    """(round trip, the rank's clock minus ours), ns, from the fastest of ``pings`` ping-pongs on ``conn``:
    the offset is wrong by at most half that round trip. (Ranks on one machine share a monotonic clock,
    so an offset within the round trip means none.)"""
    best = None
    for _ in range(pings):
        t0 = time.perf_counter_ns()
        conn.send_bytes(encode(Ping()))
        tw = decode(conn.recv_bytes()).t_ns
        t1 = time.perf_counter_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, tw - (t0 + t1) // 2)
    return best


class Out(NamedTuple):
    stream: str         # "stdout" or "stderr"
    text: str


@dataclass
class Failure:
    """Why a rank did not return a value."""
    type: str                       # exception class name, or "WorkerDied" / "Stuck"
    message: str
    traceback: str = ""
    exception: bytes | None = None  # the pickled exception, when it could be pickled
    op: str | None = None           # the torch.distributed call it failed in, if any
    interrupted: bool = False       # stopped by lablib (SIGINT) rather than failing on its own
    time: int = 0                   # perf_counter_ns when it happened (orders root causes)
    restart: bool = False           # the rank's GPU took an error every later call repeats: the pool restarts it


class Done(NamedTuple):
    job_id: int
    value: bytes | None             # ship(result, to_cpu=True); None when the job failed
    failure: Failure | None
    spans: list                     # timeline.RawSpan records
    pg_alive: bool                  # False: the job destroyed the process group


def encode(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)


# -- shipping objects --------------------------------------------------------------------------------
def _code_reduce_keeping_filename(code):
    ctor, args = cloudpickle.cloudpickle._code_reduce(code)
    return ctor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table)
    to_cpu = False

    def reducer_override(self, obj):
        if self.to_cpu and type(obj).__module__.startswith("torch") and _is_device_tensor(obj):
            return (_identity, (obj.detach().cpu(),))
        return super().reducer_override(obj)


def _is_device_tensor(obj):
    import torch

    return isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta")


def _identity(x):
    return x


class PerRank(tuple):
    """One value per rank, as an argument of ``Cluster.run``: rank r's call gets only the r-th, and no other
    rank's is shipped to it (a check's inputs reach each rank as its own share, never as a seed it could
    rebuild every rank's from)."""


def for_rank(args: tuple, kwargs: dict, rank: int, world_size: int) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` as rank ``rank`` gets them: each ``PerRank`` replaced by its value for that rank."""
    def pick(value):
        if not isinstance(value, PerRank):
            return value
        if len(value) != world_size:
            raise TypeError(f"a PerRank argument holds {len(value)} values for {world_size} ranks: give one per rank")
        return value[rank]

    return tuple(map(pick, args)), {k: pick(v) for k, v in kwargs.items()}


def payloads(fn, args: tuple, kwargs: dict, world_size: int) -> list[bytes]:
    """What each rank is sent of ``fn(*args, **kwargs)``: the same payload, or each its own where an argument
    is a ``PerRank``."""
    if any(isinstance(v, PerRank) for v in (*args, *kwargs.values())):
        return [ship((fn, *for_rank(args, kwargs, r, world_size))) for r in range(world_size)]
    return [ship((fn, args, kwargs))] * world_size


def messages(job_id: int, gen: int, debug: bool, payloads: list[bytes], sources: dict) -> list[bytes]:
    """The encoded Job for each rank, each distinct payload encoded once."""
    encoded = {p: encode(Job(job_id, gen, debug, p, sources)) for p in set(payloads)}
    return [encoded[p] for p in payloads]


def ship(obj, to_cpu: bool = False) -> bytes:
    """``obj`` as bytes a rank (or the parent) can ``unship``."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.to_cpu = to_cpu
    pickler.dump(obj)
    return buf.getvalue()


def unship(blob: bytes):
    return cloudpickle.loads(blob)
