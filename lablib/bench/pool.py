"""The rank pool's own claims: a job against torch.multiprocessing.spawn per cell (P1), what tracing a
training step costs (P7), and how fast a failure reaches the cell (F). The jobs that run on the ranks
first."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import statistics
import threading
import time

from .rows import Row, Settings, timed


def trivial():
    import torch
    import torch.distributed as dist

    x = torch.ones(4)
    dist.all_reduce(x)
    return x[0].item()


def raise_on_rank0():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(4))


def stuck_on_rank0():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.all_reduce(torch.ones(4))


def training_steps(steps: int, width: int = 512, layers: int = 4, batch: int = 64) -> tuple[float, float]:
    """Median seconds of a data-parallel MLP step without lablib's spans and traced collectives, and with them:
    ``steps`` of each, taking turns step by step, so drift in the machine's load hits both alike."""
    import torch
    import torch.distributed as dist

    from .. import comm
    from ..timeline import span

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(batch, width)
    times = {False: [], True: []}
    for k in range(2 * steps):
        traced = bool(k % 2)
        t = time.perf_counter()
        h = x
        for i, layer in enumerate(model):
            with span(f"fwd L{i}") if traced else contextlib.nullcontext():
                h = torch.relu(layer(h))
        with span("bwd") if traced else contextlib.nullcontext():
            h.square().mean().backward()
        for p in model.parameters():
            comm.all_reduce(p.grad, name="grad all_reduce") if traced else dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
        times[traced].append(time.perf_counter() - t)
    return statistics.median(times[False]), statistics.median(times[True])


def _spawn_target(rank, world_size, port):
    import torch.distributed as dist

    # torch 2.8's Gloo writes "[Gloo] Rank N is connected to ..." to fd 1 from C++; the anchor's ranks
    # share our stdout, so their lines would land inside the table
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    trivial()
    dist.destroy_process_group()


def spawn_per_cell(world_size: int) -> float:
    """What the pool replaces: torch.multiprocessing.spawn of fresh ranks for one small job."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    mp.spawn(_spawn_target, args=(world_size, port), nprocs=world_size)
    return time.perf_counter() - t


def p1_pool(s: Settings) -> list[Row]:
    from ..pool import Cluster

    rows = []
    jobs = 50 if s.quick else 200
    for n in (2, 4):
        starts, spawns = [], []
        for _ in range(s.reps):
            c = Cluster(n, backend=s.backend, timeout=10, quiet=True)
            starts.append(c.start_seconds)
            c.close()
            spawns.append(spawn_per_cell(n))
        with Cluster(n, backend=s.backend, timeout=10, quiet=True) as c:
            for _ in range(10):
                c.run(trivial)
            job = [statistics.median(timed(lambda: c.run(trivial), jobs)) * 1e3 for _ in range(s.reps)]
        four = n == 4  # the targets are set at 4 ranks
        rows.append(Row("P1", f"a small all-reduce job, {n} ranks", "ms", job, [x * 1e3 for x in spawns],
                        "mp.spawn per cell", "<= 10 ms at 4 ranks" * four,
                        statistics.median(job) <= 10 if four else None))
        rows.append(Row("P1", f"first start of the pool, {n} ranks", "s", starts, spawns, "mp.spawn per cell",
                        "<= 5 s at 4 ranks" * four, statistics.median(starts) <= 5 if four else None))
    return rows


def p7_tracing(s: Settings) -> list[Row]:
    from ..pool import Cluster

    steps = 20 if s.quick else 60
    rows = []
    for n in (2, 4):
        plain, traced = [], []
        with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
            for _ in range(s.reps + 1):
                ranks = c.run(training_steps, steps)  # the slowest rank's median, with and without tracing
                plain.append(max(r[0] for r in ranks) * 1e3)
                traced.append(max(r[1] for r in ranks) * 1e3)
        row = Row("P7", f"DP training step, traced, {n} ranks", "ms", traced, plain, "the same step untraced",
                  "<= 1.05 x")
        row.met = row.ratio <= 1.05
        rows.append(row)
    return rows


def ping_pong(strict: bool, count: int, nbytes: int = 4096) -> float:
    """Seconds per message, ranks 0 and 1 passing ``nbytes`` back and forth with lablib's send and recv."""
    import torch
    import torch.distributed as dist

    from .. import messages, p2p

    x, me = torch.zeros(nbytes // 4), dist.get_rank()
    with p2p.strict(strict):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(count // 2):
            if me == 0:
                messages.send(x, 1)
                messages.recv(x, 1)
            elif me == 1:
                messages.recv(x, 0)
                messages.send(x, 0)
        return (time.perf_counter() - t) / (count // 2 * 2)


def p13_strict(s: Settings) -> list[Row]:
    """Strict mode (lablib.p2p: NCCL's point-to-point rules held on Gloo, on in every check) against plain
    Gloo: a message's latency, and the rank job of lab 02's ring check with lablib's ring."""
    from .. import p2p
    from ..answers.lab02 import ring_all_gather
    from ..checks.lab02 import ring_job, ring_shares
    from ..pool import Cluster

    count = 100 if s.quick else 400
    latency, job = ([], []), ([], [])
    with Cluster(2, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps + 1):  # interleaved, so drift in machine load hits both alike
            for i, strict in enumerate((True, False)):
                latency[i].append(c.run(ping_pong, strict, count)[0] * 1e3)
    with Cluster(4, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps + 1):
            for i, fn in enumerate((p2p.strictly(ring_job), ring_job)):
                t = time.perf_counter()
                c.run(fn, ring_all_gather, "all_gather", ring_shares("all_gather", 4))
                job[i].append((time.perf_counter() - t) * 1e3)
    return [Row("P13", "a 4 KiB message, send and recv between 2 ranks, in strict mode", "ms", latency[0][1:],
                latency[1][1:], "plain Gloo", note="strict mode adds store round trips per message"),
            Row("P13", "lab 02's ring check job (lablib's ring all-gather, 4 ranks), in strict mode", "ms", job[0][1:],
                job[1][1:], "plain Gloo")]


def failures(s: Settings) -> list[Row]:
    from ..pool import Cluster, RankError

    def expect_error(c, fn):
        try:
            c.run(fn)
        except RankError:
            return
        raise AssertionError("expected a RankError")

    rows = []
    for n in (2, 4):
        with Cluster(n, backend=s.backend, timeout=2, quiet=True) as c:
            error = timed(lambda: expect_error(c, raise_on_rank0), 3 * s.reps)
            hang = timed(lambda: expect_error(c, stuck_on_rank0), s.reps)

            def stop():
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
                t0 = time.perf_counter()
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        c.run(stuck_on_rank0)
                except KeyboardInterrupt:
                    return time.perf_counter() - t0 - 0.5
                raise AssertionError("expected KeyboardInterrupt")

            stops = [stop() for _ in range(s.reps)]
            c.run(trivial)
        rows += [Row("F", f"a rank's exception back in the cell, {n} ranks", "s", error, target="<= 1 s",
                     met=max(error) <= 1),
                 Row("F", f"a hang reported, timeout=2 s, {n} ranks", "s", hang, target="<= timeout + 2 s",
                     met=max(hang) <= 4),
                 Row("F", f"stop button to every rank stopped, {n} ranks", "s", stops, target="<= 2 s",
                     met=max(stops) <= 2)]
    return rows
