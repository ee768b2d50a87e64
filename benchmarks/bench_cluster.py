"""Measures the rank pool against its targets, on this machine.

    python benchmarks/bench_cluster.py            # about a minute on 2 cores

Targets: first start <= 5 s at 4 ranks; a trivial job (one small all_reduce) <= 10 ms median at
4 ranks; a rank's exception back in the cell <= 1 s; tracing <= 5% of a lab-sized training step.
For comparison it also times what the pool replaces: torch.multiprocessing.spawn per cell.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lablib
from lablib import Cluster, RankError


def trivial():
    x = torch.ones(4)
    dist.all_reduce(x)
    return x[0].item()


def raise_on_rank0():
    if dist.get_rank() == 0:
        raise ValueError("boom")
    dist.all_reduce(torch.ones(4))


def stuck_on_rank0():
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.all_reduce(torch.ones(4))


def training_steps(steps: int, traced: bool, width: int = 512, layers: int = 4, batch: int = 64):
    """A data-parallel MLP step: forward, backward, one all-reduce per gradient, SGD. Returns the
    median step time in seconds, with spans and traced collectives or with plain ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(batch, width)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        if traced:
            h = x
            for i, layer in enumerate(model):
                with lablib.span(f"fwd L{i}"):
                    h = torch.relu(layer(h))
            with lablib.span("bwd"):
                h.square().mean().backward()
            for p in model.parameters():
                lablib.all_reduce(p.grad, name="grad all_reduce")
        else:
            h = x
            for layer in model:
                h = torch.relu(layer(h))
            h.square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _spawn_target(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    trivial()
    dist.destroy_process_group()


def spawn_per_cell(world_size: int) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    mp.spawn(_spawn_target, args=(world_size, port), nprocs=world_size)
    return time.perf_counter() - t


def timed(fn, repeat):
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    rep = 2 if args.quick else 3
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}\n")
    print(f"{'measure':<48} {'2 ranks':>12} {'4 ranks':>12}   target")
    rows = {}
    for n in (2, 4):
        starts = []
        for _ in range(rep):
            c = Cluster(n, backend="gloo", timeout=2, quiet=True)
            starts.append(c.start_seconds)
            c.close()
        rows.setdefault("first start (s), median", {})[n] = statistics.median(starts)
        rows.setdefault("mp.spawn per cell (s), what the pool replaces", {})[n] = statistics.median(
            spawn_per_cell(n) for _ in range(rep))
        with Cluster(n, backend="gloo", timeout=2, quiet=True) as c:
            for _ in range(20):
                c.run(trivial)
            t = timed(lambda: c.run(trivial), args.jobs)
            rows.setdefault("trivial job (ms), median", {})[n] = statistics.median(t) * 1e3
            rows.setdefault("trivial job (ms), p90", {})[n] = sorted(t)[int(0.9 * len(t))] * 1e3

            def expect_error(fn):
                try:
                    c.run(fn)
                except RankError:
                    return
                raise AssertionError("expected a RankError")

            t = timed(lambda: expect_error(raise_on_rank0), 10)
            rows.setdefault("rank exception -> RankError (s), max of 10", {})[n] = max(t)
            t = timed(lambda: expect_error(stuck_on_rank0), 2)
            rows.setdefault("hang -> RankError, timeout=2 (s), max of 2", {})[n] = max(t)

            def interrupted():
                timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
                timer.start()
                t0 = time.perf_counter()
                try:
                    c.run(stuck_on_rank0)
                except KeyboardInterrupt:
                    return time.perf_counter() - t0 - 0.5
                raise AssertionError("expected KeyboardInterrupt")

            import contextlib
            import io

            with contextlib.redirect_stderr(io.StringIO()):
                rows.setdefault("stop button -> all ranks stopped (s)", {})[n] = max(interrupted() for _ in range(2))
            c.run(trivial)

            steps = 30 if args.quick else 60
            plain, traced = [], []
            for _ in range(rep + 2):  # interleaved, so drift in machine load hits both alike
                plain.append(max(c.run(training_steps, steps, False)))
                traced.append(max(c.run(training_steps, steps, True)))
            p, tr = statistics.median(plain), statistics.median(traced)
            rows.setdefault("training step, plain dist (ms)", {})[n] = p * 1e3
            rows.setdefault("training step, traced (ms)", {})[n] = tr * 1e3
            rows.setdefault("tracing overhead (%)", {})[n] = (tr / p - 1) * 100
    targets = {"first start (s), median": "<= 5 s at 4 ranks", "trivial job (ms), median": "<= 10 ms at 4 ranks",
               "rank exception -> RankError (s), max of 10": "<= 1 s", "hang -> RankError, timeout=2 (s), max of 2": "<= timeout + 2 s",
               "stop button -> all ranks stopped (s)": "<= 2 s", "tracing overhead (%)": "<= 5 %"}
    for name, vals in rows.items():
        print(f"{name:<48} {vals[2]:>12.3f} {vals[4]:>12.3f}   {targets.get(name, '')}")
    print("\ntraining step: 4x Linear(512, 512), batch 64, one all_reduce per gradient; spans on every layer.")


if __name__ == "__main__":
    main()
