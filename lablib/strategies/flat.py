"""FSDP's flat parameters: a unit's parameters concatenated into one buffer, padded to a multiple of
the world size, and cut into equal shards, one per rank (PyTorch FSDP, Zhao et al. 2023,
https://arxiv.org/abs/2304.11277; FSDP1's FlatParameter. FSDP2 shards each parameter on its own).

Equal shards make every collective a plain, even split; the padding costs at most N-1 elements per
unit. ``setup`` moves a model's parameters into such buffers and keeps what a strategy keeps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer padded to ``world_size`` equal shards."""
    shapes: tuple
    world_size: int

    @staticmethod
    def of(params, world_size: int) -> "FlatLayout":
        return FlatLayout(tuple(tuple(p.shape) for p in params), world_size)

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for n in self.numels:
            out.append(o)
            o += n
        return out

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)  # ceil: the last shards carry the padding

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view into ``flat`` (the full buffer)."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """Copy ``tensors`` (shaped like the parameters) into a new padded flat buffer."""
        flat = torch.zeros(self.padded_numel, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat


@dataclass(slots=True)  # no attributes besides these: what a rank holds is what the checks count
class Unit:
    module: nn.Module
    layout: FlatLayout
    flat: torch.Tensor
    shard: torch.Tensor
    master: torch.Tensor
    state: dict
    grad: torch.Tensor | None = None
    work: object = None  # a collective in flight for this unit (lab 03: an async_op=True handle)
    took_grad: bool = False  # full_grad() was called since the parameters' gradients were last set
    group: object = None  # the process group its shards are spread over (None: every rank)

    def full_grad(self) -> torch.Tensor:
        """The unit's parameter gradients in one padded flat buffer (the per-parameter ones are freed)."""
        from ..timeline import span

        params = list(self.module.parameters())
        if self.took_grad and all(p.grad is None for p in params):
            raise RuntimeError("this unit's full_grad() was called twice in one backward: the first call took its "
                               "gradients (and freed them), so this one would return zeros. Keep what the first "
                               "call returned.")
        self.took_grad = True
        with span("copy grads", op="compute"):
            return flat_grad(self)


def setup(model: nn.Sequential, rank: int, world_size: int, init_state, sharded: bool = True,
          frees_params: bool = False, dtype=torch.float32, group=None) -> list[Unit]:
    """Move each unit's parameters into a flat buffer and keep what a strategy keeps on this rank.

    ``group``: the process group the shards are spread over (``rank`` and ``world_size`` are then this rank's
    index in it and its size), for data parallelism beside other axes; None: every rank.

    ``sharded``: the buffer is padded and split over the ranks (False: replicated, one shard of all).
    ``frees_params``: only the shard persists; the flat buffer is a gather buffer, freed between uses.
    ``init_state(master)``: the optimizer state for this rank's fp32 master values."""
    units = []
    for module in model:
        params = list(module.parameters())
        layout = FlatLayout.of(params, world_size if sharded else 1)  # replicated: no padding
        flat = layout.flatten([p.detach() for p in params], dtype)
        for p, view in zip(params, layout.views(flat)):
            p.data = view  # the module computes with views into the flat buffer
        start, end = layout.shard_bounds(rank if sharded else 0)
        shard = flat[start:end]
        if frees_params:
            shard = shard.clone()
            flat.untyped_storage().resize_(0)
        master = shard if dtype == torch.float32 else shard.float()
        units.append(Unit(module, layout, flat, shard, master, init_state(master), group=group))
    return units


def flat_grad(unit: Unit) -> torch.Tensor:
    """The unit's parameter gradients in one padded flat buffer; the per-parameter grads are freed."""
    params = list(unit.module.parameters())
    grad = unit.layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    for p in params:
        p.grad = None
    return grad
