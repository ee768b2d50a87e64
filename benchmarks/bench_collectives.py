"""Bus bandwidth of the ring collectives vs torch.distributed vs a memory copy, on this machine.

    python benchmarks/bench_collectives.py [--iters 5] [--size-mb 16]

The same sweep lab 02 runs (lablib.collectives.sweep), printed as a table at one size, plus the ratio
of Gloo's reduce-scatter time to the ring's and the fitted alpha-beta model.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from lablib import Cluster, collectives


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--size-mb", type=int, default=16, help="the size of the table, in MiB")
    args = ap.parse_args()
    os.environ["LABLIB_QUICK"] = "0"
    size = args.size_mb << 20
    rows = []
    for n in (2, 4):
        with Cluster(n, backend="auto", timeout=60, quiet=True) as c:
            rows += collectives.sweep(c, collectives.sweep_sizes(), iters=args.iters)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"\nbusbw (GB/s) at {args.size_mb} MiB, median of {args.iters}, slowest rank:")
    print(f"{'':24s} {'N=2':>8s} {'N=4':>8s}")
    pick = {(r["op"], r["impl"], r["n"]): r for r in rows if r["bytes"] == size}
    for op, impl, label in [("all_gather", "ring", "ring all-gather"), ("all_gather", "torch", "torch all-gather"),
                            ("reduce_scatter", "ring", "ring reduce-scatter"),
                            ("reduce_scatter", "torch", "torch reduce-scatter"),
                            ("all_reduce", "ring", "ring all-reduce"), ("all_reduce", "torch", "torch all-reduce"),
                            ("memcpy", "torch", "memory copy")]:
        print(f"{label:24s} " + " ".join(f"{pick[(op, impl, n)]['busbw']:8.2f}" for n in (2, 4)))
    for n in (2, 4):
        ratio = pick[("reduce_scatter", "torch", n)]["seconds"] / pick[("reduce_scatter", "ring", n)]["seconds"]
        print(f"N={n}: Gloo reduce-scatter time / ring reduce-scatter time = {ratio:.2f}")
    alpha, beta = collectives.fit_alpha_beta(rows)
    print(f"ring all-gather fit: alpha = {alpha * 1e6:.0f} us per step, beta = {beta / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
