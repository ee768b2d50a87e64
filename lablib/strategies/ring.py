"""Ring collectives from point-to-point messages, and how to measure any collective.

The ring (Patarasuk & Yuan, 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; used by NCCL and Horovod): rank r sends only to r+1 and receives only from r-1, and
the data is cut into N chunks.

- all-gather: N-1 steps; at step s rank r forwards chunk (r - s) and receives chunk (r - s - 1).
- reduce-scatter: N-1 steps; at step s rank r sends its partial sum of chunk (r - s - 1) and adds the
  partial sum of chunk (r - s - 2) it receives; after the last step it holds the full sum of chunk r.
- all-reduce = reduce-scatter + all-gather.
(lablib's own, the answers to lab 02's tasks, are in ``lablib.answers.lab02``.)

Each rank sends (N-1)/N of the data per all-gather or reduce-scatter, 2(N-1)/N per all-reduce: the
lower bound for any algorithm built from point-to-point messages, whatever N is (a switch that
reduces in the network, like NVLink SHARP, sends less).
"""
from __future__ import annotations


# -- what moved where, from a real run -----------------------------------------------------------------
def transfers(timeline) -> list[list[tuple[int, int, int]]]:
    """Per step, the (src, dst, chunk) of every message the ring sent, read from a run's timeline."""
    steps: dict[int, list] = {}
    for s in timeline.spans:
        if s.meta.get("op") == "send" and "step" in s.meta:
            steps.setdefault(s.meta["step"], []).append((s.rank, s.meta["peer"], s.meta["chunk"]))
    return [sorted(steps[k]) for k in sorted(steps)]
