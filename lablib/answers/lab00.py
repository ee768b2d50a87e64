"""Lab 00's answer: the mean of a tensor over the ranks."""
from __future__ import annotations

import torch.distributed as dist

from .. import comm

TASKS = {"Task 0.1": ("mean_across_ranks",)}


def mean_across_ranks(x):
    comm.all_reduce(x)
    return x / dist.get_world_size()
