"""Pipeline parallelism on the ranks: whole layers on different ranks, micro-batches flowing through them.

A model of L blocks is cut into S equal stages; stage s lives on rank s % p. A rank runs its list of
actions (schedules.py: the schedules as data) with a ``Stage`` per stage it holds: forward, backward,
input-only backward and weight backward of its blocks, each recorded on the timeline, counted for
activation memory and logged, in simulated-compute mode each lasting a fixed time. Then lablib's
executor: receive what an action needs, compute, send what it made. The checks' jobs and PyTorch's own
schedules (``torch.distributed.pipelining``) are in pp_reference.py.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..timeline import _now, span
from ..toy import generator, seeded


class Block(nn.Module):
    """x + GELU(fc(x)): the residual keeps the first blocks' gradients as large as the last ones'."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


def model(width: int = 32, layers: int = 8, seed: int = 0) -> nn.Sequential:
    """The lab's model: ``layers`` residual blocks of width ``width``, the same on every rank."""
    with seeded(seed):
        return nn.Sequential(*[Block(width) for _ in range(layers)])


def data(width: int, rows: int, m: int, seed: int = 0):
    """The batch (rows × width) and its targets, cut into m micro-batches."""
    g = generator(11 + 1_000_003 * seed)
    x, y = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    return list(x.chunk(m)), list(y.chunk(m))


def loss_fn(out, target, m):
    """One micro-batch's share of the batch's mean squared error (the batch's loss is their sum)."""
    return F.mse_loss(out, target) / m


class Held:
    """Bytes of activations held on a rank (by all of its stages): now, and at most; and the actions its
    stages ran, in order ("F", "B" for an input-only backward, "BW" for a whole one, "W"): private, as
    Task 5.4's check judges the executor from it and the executor holds the stages."""

    def __init__(self):
        self.live = self.peak = 0
        self._log: list[tuple[str, int, int]] = []

    def actions(self) -> list[tuple[str, int, int]]:
        return list(self._log)

    def add(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)


class Stage:
    """Stage ``index`` of ``stages``: its blocks of the model, its micro-batches' inputs (first stage) or
    targets (last), and what each micro-batch keeps between its forward and its backward.

    ``forward(mb, x)`` returns the output to send on (None on the last stage, which computes the loss);
    ``backward(mb, grad, weights=True)`` the gradient to send back (None on the first stage), and with
    ``weights=False`` leaves the weights' gradient to ``backward_weight(mb)``. ``buffer()`` is an
    empty tensor of the activations' shape, to receive into. ``cost``: seconds per block for F, B and W
    (a full backward 2×) spent waiting, after the real compute: the simulated-compute mode."""

    def __init__(self, blocks, index: int, stages: int, inputs, targets, cost: float | None = None,
                 rank_held: Held | None = None):
        self.blocks, self.index, self.stages = blocks, index, stages
        self.first, self.last = index == 0, index == stages - 1
        self.inputs, self.targets, self.m = inputs, targets, len(inputs)
        self.cost = cost
        self.linears = [b.fc for b in blocks]
        self._held: dict[int, dict] = {}
        self.held = Held()              # bytes of activations this stage holds, now and at most
        self.rank_held = rank_held      # the same for all the rank's stages together
        self.per_mb = 0                 # bytes one micro-batch's forward keeps
        self.busy = 0.0                 # seconds spent in F, B and W

    def buffer(self) -> torch.Tensor:
        return torch.empty_like(self.inputs[0])

    def _timed(self, name: str, kind: str, mb: int, units: float):
        if self.rank_held is not None:
            self.rank_held._log.append(({"forward": "F", "weight_grad": "W"}.get(kind) or ("BW" if units == 2 else "B"),
                                       mb, self.index))
        return _Timed(self, name, kind, mb, units)

    def forward(self, mb: int, x=None):
        if self.first:
            x = self.inputs[mb]
        elif x is None:
            raise ValueError(f"stage {self.index}'s forward of micro-batch {mb} needs the activations received from "
                             f"stage {self.index - 1}")
        with self._timed(f"F{mb}", "forward", mb, 1):
            # the first stage computes its input's gradient too (and sends it nowhere): every stage's B then
            # does the same work, as the papers' bubble formulas assume
            x = x.detach().requires_grad_()
            zs, acts, h = [], [], x
            for block in self.blocks:
                acts.append(h)
                z = block.fc(h)
                zs.append(z)
                h = h + F.gelu(z)
            out = loss_fn(h, self.targets[mb], self.m) if self.last else h
            kept = sum(t.nbytes for t in acts + zs) + h.nbytes
        self._held[mb] = dict(x=x, out=out, zs=zs, acts=acts, bytes=kept)
        self.per_mb = max(self.per_mb, kept)
        self._count(kept)
        return None if self.last else out.detach()

    def backward(self, mb: int, grad=None, weights: bool = True):
        held = self._held.get(mb)
        if held is None or "grads" in held:
            raise ValueError(f"stage {self.index}: backward of micro-batch {mb} " +
                             ("before its forward" if held is None else "a second time"))
        if not self.last and grad is None:
            raise ValueError(f"stage {self.index}'s backward of micro-batch {mb} needs the gradient received from stage "
                             f"{self.index + 1}")
        with self._timed(f"B{mb}", "backward", mb, 2 if weights else 1):
            grad = None if self.last else grad
            if weights:
                torch.autograd.backward(held["out"], grad)
                gx = None if self.first else held["x"].grad
                self._held.pop(mb)
                self._count(-held["bytes"])
            else:  # the gradient of the input and of each Linear's output; the weights' wait for W
                wrt = [held["x"]] + held["zs"]
                grads = torch.autograd.grad(held["out"], wrt, grad)
                gx = None if self.first else grads[0]
                held["grads"] = grads[1:]
                self._count(sum(g.nbytes for g in held["grads"]) - held["bytes"] + sum(a.nbytes for a in held["acts"]))
                held["bytes"] = sum(g.nbytes for g in held["grads"]) + sum(a.nbytes for a in held["acts"])
                held.pop("zs"), held.pop("out"), held.pop("x")
        return None if gx is None else gx.detach()

    def backward_weight(self, mb: int) -> None:
        held = self._held.get(mb)
        if held is None or "grads" not in held:
            raise ValueError(f"stage {self.index}: W of micro-batch {mb} before its B (with weights=False)")
        with self._timed(f"W{mb}", "weight_grad", mb, 1):
            for lin, a, g in zip(self.linears, held["acts"], held["grads"]):
                gw, gb = g.T @ a, g.sum(0)
                lin.weight.grad = gw if lin.weight.grad is None else lin.weight.grad + gw
                lin.bias.grad = gb if lin.bias.grad is None else lin.bias.grad + gb
        self._held.pop(mb)
        self._count(-held["bytes"])

    def _count(self, delta: int) -> None:
        self.held.add(delta)
        if self.rank_held is not None:
            self.rank_held.add(delta)


class _Timed(span):
    """The span of one F, B or W; in simulated-compute mode it lasts ``cost`` × blocks × ``units``."""

    __slots__ = ("stage", "units")

    def __init__(self, stage, name, op, mb, units):
        super().__init__(name, "compute", op=op, mb=mb, stage=stage.index, label=name,
                         **({"simulated": f"{stage.cost * 1e3:g} ms per block"} if stage.cost else {}))
        self.stage, self.units = stage, units

    def __exit__(self, *exc):
        if self.stage.cost and exc[0] is None:
            _sleep_until(self.t0 + self.stage.cost * 1e9 * len(self.stage.blocks) * self.units)
        super().__exit__(*exc)
        self.stage.busy += (_now() - self.t0) / 1e9
        return False


def _sleep_until(t_ns: float) -> None:
    left = (t_ns - _now()) / 1e9
    if left > 0:
        time.sleep(left)


def stages_of(rank: int, p: int, v: int, blocks, inputs, targets, cost=None) -> dict[int, Stage]:
    """The stages rank ``rank`` holds, {index: Stage}: ``blocks`` cut into p·v equal stages, counting the
    activations they hold together in one ``Held``."""
    n, held = p * v, Held()
    per = len(blocks) // n
    return {s: Stage(blocks[s * per:(s + 1) * per], s, n, inputs, targets, cost, held) for s in range(rank, n, p)}

