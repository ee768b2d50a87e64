"""Lab 02 (collectives): Tasks 2.1-2.4, the learner's rings against torch.distributed's own collectives
on 2, 3 and 4 ranks, several dtypes and sizes, sending exactly the ring's messages."""
from __future__ import annotations

import random

import torch

from ..comm import ring_steps
from ..pool import PerRank
from ..pool.failures import NCCL_RULES
from ..rules.policy import COLLECTIVES
from ..toy import generator
from . import Check, CheckFailed, run_on_ranks

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bfloat16": torch.bfloat16}


def ring_cases(seed: int | None = None) -> list[tuple[str, int]]:
    """(dtype, chunk size) cases: fixed ones, or ones drawn from ``seed``."""
    if seed is None:
        return [("float32", 1), ("float32", 7), ("float64", 1000), ("int64", 5), ("bfloat16", 64)]
    rng = random.Random(seed)
    return [(dtype, rng.randint(1, 300)) for dtype in _DTYPES]


_TORCH_NAME = {"all_gather": "dist.all_gather_into_tensor", "reduce_scatter": "dist.reduce_scatter_tensor",
               "all_reduce": "dist.all_reduce"}


def ring_input(op: str, n: int, rank: int, dtype: str, chunk: int, seed=None) -> torch.Tensor:
    """Rank ``rank``'s input in one case (the same on the ranks and in the judge)."""
    g = generator(100 * rank + chunk + (seed or 0))
    numel = chunk if op == "all_gather" else chunk * n - (1 if op == "all_reduce" and n > 1 else 0)
    return (torch.randn(numel, generator=g) * 8).to(_DTYPES[dtype])  # all-reduce: a size n does not divide


def expected(op: str, n: int, rank: int, dtype: str, chunk: int, seed=None) -> torch.Tensor:
    """What torch.distributed's collective leaves on ``rank``, computed in one process (in float64)."""
    xs = [ring_input(op, n, r, dtype, chunk, seed).double() for r in range(n)]
    if op == "all_gather":
        return torch.cat(xs)
    total = torch.stack(xs).sum(0)
    return total if op == "all_reduce" else total[rank * chunk:(rank + 1) * chunk]


def ring_shares(op: str, n: int, seed=None) -> PerRank:
    """Each rank's inputs, case by case: (dtype, chunk size, its own tensor), made here from the seed: no rank
    gets the seed, or another rank's tensor."""
    return PerRank([[(dtype, chunk, ring_input(op, n, rank, dtype, chunk, seed)) for dtype, chunk in ring_cases(seed)]
                    for rank in range(n)])


def ring_job(fn, op: str, cases: list) -> list:
    """On each rank, for every case: the learner's result, the bytes of each message it sent through
    lablib, and the library collectives it called: as lablib's traced calls recorded them (comm.watched),
    not from the timeline's spans, which ``lablib.span`` in exercise code could add to."""
    import torch.distributed as dist

    from ..comm import to_device, watched

    n = dist.get_world_size()
    out = []
    for dtype, chunk, x in cases:
        x = to_device(x)
        if op == "all_reduce":
            got = x.clone()
            _, ops = watched(fn, got)
        else:
            got = torch.zeros(chunk * n if op == "all_gather" else chunk, dtype=x.dtype, device=x.device)
            _, ops = watched(fn, got, x.clone())
        ops = [o.split(" ") for o in ops]
        sent = [int(nbytes) for name, nbytes in ops if name == "send"]
        collectives = {name for name, _ in ops} & set(_TORCH_NAME)
        out.append([got, sent, sorted(collectives)])
    return out


def judge_ring(task: str, op: str, n: int, per_rank: list, fn_name: str, seed=None) -> str:
    """Raises CheckFailed at the first case where a rank's result or messages are wrong."""
    steps, cases = ring_steps(op, n), ring_cases(seed)
    if not isinstance(per_rank, list) or len(per_rank) != n:
        raise CheckFailed(f"{task}: expected one result per rank from {n} ranks.")
    for rank, results in enumerate(per_rank):
        if not isinstance(results, list) or len(results) != len(cases):
            raise CheckFailed(f"{task}: expected {len(cases)} results from rank {rank}.")
        for (dtype, chunk), (got, sent, collectives) in zip(cases, results):
            sends = len(sent)
            where = f"{fn_name} on {n} ranks, {dtype}, chunks of {chunk}"
            if collectives:
                raise CheckFailed(f"{task}: {where}: rank {rank} called {', '.join(collectives)}. Build the ring "
                                  "from point-to-point messages only (lablib.send/recv/exchange).")
            if sends != steps:
                raise CheckFailed(
                    f"{task}: {where}: rank {rank} sent {sends} message(s) through lablib's send/exchange, the ring "
                    f"sends {steps} ({'2 x ' if op == 'all_reduce' else ''}N-1 steps, one message each). "
                    "Use lablib.send/recv/exchange (so the timeline can show the ring), one send per step.")
            chunk_bytes = chunk * _DTYPES[dtype].itemsize  # the all-reduce's padded chunk too
            if any(b != chunk_bytes for b in sent):
                raise CheckFailed(
                    f"{task}: {where}: rank {rank} sent messages of {sorted(set(sent))} bytes; each ring step "
                    f"sends one chunk, {chunk_bytes} bytes. Send whole chunks, one per step.")
            want = expected(op, n, rank, dtype, chunk, seed)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise CheckFailed(f"{task}: {where}: rank {rank}'s output has shape "
                                  f"{tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}")
            kind = _DTYPES[dtype]
            tol = 0 if not kind.is_floating_point else (64 if kind == torch.bfloat16 else 4) * torch.finfo(kind).eps * n * 8 * 4
            diff = (got.double() - want.double()).abs()
            if not diff.max().item() <= tol:  # NaN too
                bad = sorted({int(i) // max(chunk, 1) for i in (~(diff <= tol)).nonzero().flatten().tolist()})
                raise CheckFailed(
                    f"{task}: {where}: rank {rank}'s result differs from what {_TORCH_NAME[op]} gives "
                    f"(by up to {diff.max().item():.3g}) in chunk(s) {bad[:6]}. {_RING_OP_HINTS[op]}")


def _ring_check(task: str, op: str, params: tuple, forbidden: dict) -> Check:
    def collect(fns, pool, seed):
        strict = _SENDS_FIRST if task == "Task 2.1" else _UNGROUPED
        return run_on_ranks(pool, task, ring_job, fns[0], op, ring_shares(op, pool.world_size, seed),
                            hints=((NCCL_RULES, strict),) + _RING_HINTS)

    def judge(data, world_size, seed):
        judge_ring(task, op, world_size, data, params[0], seed)
        return (f": {op.replace('_', '-')} matches {_TORCH_NAME[op]} on {world_size} ranks for "
                f"{len(ring_cases(seed))} dtype/size cases, with {'2(N-1)' if op == 'all_reduce' else 'N-1'} "
                "messages per rank")

    return Check(task, params, collect, judge, world_sizes=(2, 3, 4), forbidden=forbidden, every_size=True)


_BLOCKING = {**COLLECTIVES, **{name: "Task 2.1 asks for blocking lablib.send and lablib.recv (the exchange comes "
                                    "in Task 2.2)" for name in ("isend", "irecv", "exchange")}}
check_ring_blocking = _ring_check("Task 2.1", "all_gather", ("ring_all_gather_blocking",), _BLOCKING)
"""Task 2.1: ring all-gather with blocking send and recv."""
check_ring_all_gather = _ring_check("Task 2.2", "all_gather", ("ring_all_gather",), COLLECTIVES)
"""Task 2.2: ring all-gather with lablib.exchange."""
check_ring_reduce_scatter = _ring_check("Task 2.3", "reduce_scatter", ("ring_reduce_scatter",), COLLECTIVES)
"""Task 2.3: ring reduce-scatter."""
check_ring_all_reduce = _ring_check("Task 2.4", "all_reduce", ("ring_all_reduce",), COLLECTIVES)
"""Task 2.4: ring all-reduce (pad, reduce-scatter, all-gather, unpad)."""


_DEADLOCK = "a deadlock: ranks are blocked in send or recv, waiting for each other (see the Hint below)."
_UNGROUPED = ("a deadlock under NCCL's rules, which these checks hold Gloo to: each rank posted its send and its "
              "receive apart, so every rank's send waits for a receive its peer has not begun. Post them together: "
              "lablib.exchange(sends=[(chunk, right)], recvs=[(buffer, left)]).wait().")
_SENDS_FIRST = ("a deadlock under NCCL's rules, which these checks hold Gloo to: a blocking send returns only once "
                "its peer has begun the matching receive, so if every rank sends first, nobody receives. Alternate "
                "the order: even ranks send first, odd ranks receive first.")
_RING_HINTS = tuple((f"in {op}", _DEADLOCK) for op in ("send", "recv", "isend", "irecv"))
_RING_OP_HINTS = {
    "all_gather": "At step s rank r sends chunk (r - s) mod N to rank r+1 and receives chunk (r - s - 1) mod N "
                  "from rank r-1: the chunk it received at the step before. Did you copy your own input into "
                  "chunk r of the output first?",
    "reduce_scatter": "At step s rank r sends its partial sum of chunk (r - s - 1) mod N and adds the chunk "
                      "(r - s - 2) mod N it receives to its own partial sum; after N-1 steps it holds the full sum "
                      "of chunk r. Did you add what you received, and write chunk r to the output at the end?",
    "all_reduce": "Pad the tensor to a multiple of N, reduce-scatter it into your chunk, all-gather the chunks "
                  "back into the padded buffer, then copy the unpadded part back into the tensor (in place).",
}
