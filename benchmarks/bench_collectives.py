"""Bus bandwidth of the ring collectives vs torch.distributed vs a memory copy, on this machine.

    python benchmarks/bench_bandwidth.py [--iters 5] [--size-mb 16]

The same sweep lab 02 runs (lablib.bandwidth.sweep), printed as a table at one size, plus the ratio
of Gloo's reduce-scatter time to the ring's and the fitted alpha-beta model.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from lablib import Cluster, bandwidth


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
            rows += bandwidth.sweep(c, bandwidth.sweep_sizes(), iters=args.iters)
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"\nat {args.size_mb} MiB, median of {args.iters}, slowest rank:")
    print(bandwidth.busbw_table(rows, size))
    for n in (2, 4):
        print(f"N={n}: Gloo reduce-scatter time / ring reduce-scatter time = {bandwidth.slowdown(rows, size, n):.2f}")
    alpha, beta = bandwidth.fit_alpha_beta(rows)
    print(f"ring all-gather fit: alpha = {alpha * 1e6:.0f} us per step, beta = {beta / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
