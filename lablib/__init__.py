"""lablib: the library the distributed-training labs import.

    import lablib
    cluster = lablib.cluster(4)          # 4 real ranks (processes), reused by every cell
    cluster.run(fn)                      # fn on every rank, results in rank order
    cluster.timeline()                   # what each rank did when

Names are loaded on first use, so a rank process (``lablib.pool.worker``) pays only for what its jobs
use. The layout: pool/ (the ranks), timeline.py, comm.py, toy.py, strategies/ (one file per
strategy), checks/ (one module per lab), views/ (notebook-side figures), course/ (release, grade),
quiz/.
"""
from __future__ import annotations

import importlib
import os
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "Cluster": "pool", "RankError": "pool", "cluster": "pool",
    "span": "timeline", "Timeline": "timeline", "Span": "timeline", "compare": "timeline",
    "profiled": "profiling", "timed": "profiling",
    "device": "comm", "to_device": "comm", "all_reduce": "comm", "all_gather": "comm", "reduce_scatter": "comm",
    "broadcast": "comm", "all_to_all": "comm", "barrier": "comm",
    "send": "messages", "recv": "messages", "isend": "messages", "irecv": "messages", "exchange": "messages",
    "attend": "strategies.context_parallel", "expert": "strategies.experts",
}
__all__ = sorted(_EXPORTS) + ["load_ipython_extension"]


_MODULES = {"bandwidth", "checks", "comm", "course", "doctor", "memory", "messages", "overlap", "p2p", "pool", "profiling", "quiz",
            "strategies", "timeline",
            "toy", "views"}


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _MODULES:  # lablib.toy etc. work without importing them first
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lablib' has no attribute {name!r}")


def __dir__():
    return __all__ + sorted(_MODULES)


def load_ipython_extension(ipython):
    """``%load_ext lablib``: registers the ``%%ranks N`` cell magic."""
    from .magic import load_ipython_extension as load

    load(ipython)


# Plotly figures render through the JSON mimetype in notebooks: stable under nbval and light (the
# text/html renderer embeds 4.8 MB of plotly.js with a fresh div id every run). Colab needs its own.
if "IPython" in sys.modules and "google.colab" not in sys.modules:
    if "plotly.io" in sys.modules:
        sys.modules["plotly.io"].renderers.default = "plotly_mimetype"
    else:
        os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype")
