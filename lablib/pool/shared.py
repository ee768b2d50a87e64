"""The notebook's shared pool, ``lablib.cluster(n)``, reused by every cell; and one spare pool of
another size, for the checks and measurements that need one (``spare``)."""
from __future__ import annotations

import os

from .cluster import Cluster

_shared: Cluster | None = None


def cluster(world_size: int | None = None, **kwargs) -> Cluster:
    """The notebook's shared pool: reused by every cell, restarted when asked for another size/options.

    ``lablib.cluster(4)`` gives 4 ranks with the default options (an option given to an earlier call is
    not kept: ``lablib.cluster(4)`` after ``lablib.cluster(4, timeout=5)`` has the 10 s timeout again);
    ``lablib.cluster()`` gives the current pool as it is (2 ranks if none).
    """
    global _shared
    c = _shared
    want = world_size if world_size is not None else (c.world_size if c and not c._closed else 2)
    if world_size is not None:
        kwargs = {**_DEFAULTS, **kwargs}
    if c is not None and not c._closed and c.world_size == want and _matches(c, kwargs):
        return c
    if c is not None:
        c.close()
    _shared = None
    _shared = Cluster(want, **kwargs)
    return _shared


_DEFAULTS = {"timeout": 10.0, "threads": None, "debug": False, "job_limit": None}


def _matches(c, kwargs):
    for key, value in kwargs.items():
        if key == "quiet":
            continue
        if key in ("backend", "device"):
            if value != "auto" and value != getattr(c, key):
                return False
        elif key in ("debug", "job_limit"):  # changed in place, no restart
            setattr(c, key, value)
        elif key == "threads" and value is None:
            if c.threads != max(1, (os.cpu_count() or 1) // c.world_size):
                return False
        elif getattr(c, key, None) != value:
            return False
    return True


_SPARE: list = []  # the one spare pool: [((size, backend, timeout, device), Cluster)]


def spare(world_size: int, backend: str = "auto", timeout: float = 10.0, device: str = "auto") -> Cluster:
    """A pool of ``world_size`` ranks beside the notebook's, kept for the next caller that needs the same
    (a source's hidden checks ask for 3 or 4 ranks several times in a row, and each new pool costs
    seconds). At most one is kept: asking for another closes it, so a notebook holds at most one idle
    extra pool (each rank holds a few hundred MB)."""
    key = (world_size, backend, timeout, device)
    if _SPARE and (_SPARE[0][0] != key or _SPARE[0][1].closed):
        _SPARE.pop()[1].close()
    if not _SPARE:
        _SPARE.append((key, Cluster(world_size, backend=backend, timeout=timeout, quiet=True, device=device)))
    return _SPARE[0][1]
