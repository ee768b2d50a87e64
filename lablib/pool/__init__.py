"""The rank pool: persistent worker processes that run a notebook's functions as real ranks.

cluster.py (the parent side), worker.py (one rank), protocol.py (the messages between them, and how
functions and results travel), failures.py (how a failed job is reported).
"""
from .cluster import Cluster, cluster, resolve_backend
from .failures import RankError

__all__ = ["Cluster", "RankError", "cluster", "resolve_backend"]
