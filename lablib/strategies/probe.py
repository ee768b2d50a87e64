"""A step whose gradients are reduced on two axes of a mesh, one of them in a low precision, for lab 10's
precision probe: each reduction's error against the exact sum of what the ranks gave it.

The mesh is data parallel × tensor parallel (2 × 2 on 4 ranks; an odd number of ranks is all data parallel),
lab 08's (``compose.mesh_groups``).
A replicated parameter of a tensor-parallel layer (a LayerNorm's weight) gets a partial gradient on each
rank of its tensor-parallel group, summed there, and then over the data-parallel group. Seen in public:
FSDP2's ``reduce_dtype=float32`` not applied to the tensor-parallel all-reduce of such parameters, so that
half of the reduction ran in bf16 (PyTorch issue 190626). A bf16 sum rounds at about 0.4% of the running
sum, an fp32 one at about 1e-7: the probe shows which axis rounds, as the loss never does.

``job`` calls a learner's ``reduction_error(reduce, x, group)`` for each axis, with ``reduce`` the step's
own reduction on that axis (it sums ``x`` over ``group`` in the case's dtype) and ``x`` this rank's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..toy import generator
from .compose import mesh_groups

AXES = ("dp", "tp")
CASES = {"tp in bf16": {"tp": torch.bfloat16}}
HIDDEN = {"dp in bf16": {"dp": torch.bfloat16}, "tp in fp16": {"tp": torch.float16}, "all fp32": {}}
NUMEL = 4096


def groups() -> dict:
    """This rank's group on each axis: lab 08's mesh, (pp, dp, tp) = (1, n/2, 2), or (1, n, 1) for an odd n
    (made once per process: a Gloo group holds threads and sockets until its process group ends)."""
    n = dist.get_world_size()
    tp = 2 if n % 2 == 0 else 1
    return {axis: g for axis, g in mesh_groups((1, n // tp, tp)).items() if axis in AXES}


def reduction(dtype, group, axis: str):
    """The step's reduction on one axis: ``x`` summed over ``group`` in ``dtype``, returned in x's dtype (x
    itself is left as it was)."""
    def reduce(x):
        y = x.to(dtype, copy=True)
        comm.all_reduce(y, group=group, name=f"all_reduce {axis}")
        return y.to(x.dtype)
    return reduce


def gradient(seed: int, rank: int, axis: str) -> torch.Tensor:
    """This rank's partial gradient on one axis: a signal the ranks share, plus its own part."""
    shared = torch.randn(NUMEL, generator=generator(31 + seed))
    own = torch.randn(NUMEL, generator=generator(37 + seed + 1009 * rank + (7 if axis == "tp" else 0)))
    return comm.to_device(shared + 0.5 * own)


def job(reduction_error, case: str, seed: int = 0) -> dict:
    """On a rank: the learner's ``reduction_error`` on each axis of the case's step; what it said, and what the
    judge needs to find the truth itself (every x and the reduction's result, and the groups' ranks)."""
    dtypes = {**CASES, **HIDDEN}[case]
    r = dist.get_rank()
    out = {}
    for axis, group in groups().items():
        reduce = reduction(dtypes.get(axis, torch.float32), group, axis)
        x = gradient(seed, r, axis)
        said = reduction_error(reduce, x.clone(), group)
        out[axis] = {"said": said, "x": x, "reduced": reduce(x.clone()), "ranks": dist.get_process_group_ranks(group)}
    return out
