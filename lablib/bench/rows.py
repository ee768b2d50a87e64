"""What every item returns and takes: a table row of one measure (the course's number and its anchor's,
every repetition), the run's settings, and the two ways of timing them."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Row:
    item: str
    measure: str
    unit: str
    ours: list = field(default_factory=list)       # the course's number, every repetition
    anchor: list = field(default_factory=list)     # what it is compared with, same run
    anchor_name: str = ""
    target: str = ""
    met: bool | None = None                        # None: no target, or not measured
    note: str = ""

    @property
    def ratio(self) -> float | None:
        ok = self.ours and self.anchor and statistics.median(self.anchor)
        return statistics.median(self.ours) / statistics.median(self.anchor) if ok else None


@dataclass
class Settings:
    quick: bool
    reps: int
    backend: str = "auto"


def timed(fn, repeat) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def side_by_side(s: Settings, n: int, ours, theirs) -> tuple[list, list]:
    """``ours(cluster)`` and ``theirs(cluster)`` on one pool of ``n`` ranks, ``s.reps`` times each,
    interleaved, so drift in the machine's load hits both alike."""
    from ..pool import Cluster

    a, b = [], []
    with Cluster(n, backend=s.backend, timeout=60, quiet=True) as c:
        for _ in range(s.reps):
            a.append(ours(c))
            b.append(theirs(c))
    return a, b
