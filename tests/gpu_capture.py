"""Capture the profiler traces ``tests/test_gputime.py`` replays, and say how each run's spans were placed.

    python tests/gpu_capture.py DIR [--device cuda|cpu] [--timeline FILE]

Runs, each job once, with LABLIB_SAVE_TRACES=DIR (``lablib.gputime.save``): lab 03's prefetching step with its
2 ranks sharing the device (Gloo between them), one 1F1B step of lab 05 on 2 ranks, and, on a GPU, lab 03's
step on NCCL at world size 1. Each rank's trace is one file, trimmed to what the placement reads (at most 8
files in all). It prints per run how many spans each clock placed, and exits 1 where a GPU run's compute was
not placed by its kernels. ``--timeline FILE`` keeps lab 03's timeline, titled with the device that ran it
(``Timeline.save_chrome_trace``; ``Timeline.load`` reads it back, to draw the chart on a machine with a
browser). ``--device cpu`` (``tests/gpu.sh --dry``) runs the same on the CPU: every span keeps the host's
clock there.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

LIMIT_BYTES = 400_000  # a trace kept for the fixtures: a few hundred KB at most


def runs(device: str):
    """(tag, world size, backend, job and its arguments) of each capture."""
    from lablib.answers import lab03, lab05
    from lablib.strategies import pp_reference, prefetch

    step = (prefetch.train, lab03.PREFETCH, "wide8", 1)
    yield "lab03-prefetch", 2, "gloo", step, {"depth": 1, "warmup": 1}
    one_f_one_b = lambda p, m, v=1: lab05.one_f_one_b(p, m)  # noqa: E731 - the signature step_job calls
    yield "lab05-1f1b", 2, "gloo", (pp_reference.step_job, lab05.execute, one_f_one_b, 4, 1, None, 1), {}
    if device == "cuda":
        yield "nccl-world1", 1, "nccl", step, {"depth": 1, "warmup": 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeline", type=Path, help="where to keep lab 03's timeline, as a Chrome trace")
    args = parser.parse_args(argv)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["LABLIB_SAVE_TRACES"] = str(out.resolve())

    from lablib import Cluster, gputime

    bad = 0
    for tag, n, backend, (fn, *fn_args), kwargs in runs(args.device):
        os.environ["LABLIB_TRACE_TAG"] = tag
        with Cluster(n, backend=backend, device=args.device, timeout=120, quiet=True) as cluster:
            cluster.run(fn, *fn_args, **kwargs)
            timeline = cluster.timeline()
            spans = timeline.spans
        if tag == "lab03-prefetch" and args.timeline:
            import torch

            where = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU"
            timeline.title = (f"lab 03's prefetching step (depth 1), {n} ranks on {where}, {cluster.backend}, "
                              f"torch {torch.__version__}")
            timeline.save_chrome_trace(args.timeline)
        clocks = collections.Counter((s.kind, s.meta.get("clock")) for s in spans if s.kind != "idle")
        print(f"{tag} ({n} rank(s), {cluster.backend}, {args.device}): "
              + ", ".join(f"{kind} by {clock}: {count}" for (kind, clock), count in sorted(clocks.items(), key=str)))
        if args.device == "cuda" and clocks[("compute", gputime.GPU)] < clocks[("compute", gputime.HOST)]:
            print(f"  {tag}: most compute spans kept the host's clock: the profiler saw no kernels for them")
            bad = 1
    files = sorted(out.glob("*.json"))
    for f in files:
        size = f.stat().st_size
        print(f"  {f.name}: {size / 1e3:.0f} KB" + ("  (over the limit)" if size > LIMIT_BYTES else ""))
        bad |= size > LIMIT_BYTES
    if len(files) > 8:
        print(f"  {len(files)} files: more than the 8 a capture may leave")
        bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main())
