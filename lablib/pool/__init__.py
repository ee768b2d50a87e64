"""The rank pool: persistent worker processes that run a notebook's functions as real ranks.

cluster.py (the parent side: processes, output, clocks), job.py (one job in flight, the stop button),
worker.py (one rank), protocol.py (the messages between them, and how functions and results travel),
failures.py (how a failed job is reported), groups.py (the process groups a job makes: the pool's timeout,
and the same ones on every rank), backend.py (NCCL or Gloo), shared.py (``lablib.cluster``).
"""
from .backend import resolve_backend
from .cluster import Cluster
from .failures import RankError
from .protocol import PerRank
from .shared import cluster, spare

__all__ = ["Cluster", "PerRank", "RankError", "cluster", "resolve_backend", "spare"]
