"""Data parallelism without the redundancy: replicated DP, ZeRO-1 and ZeRO-2, on flat parameters.

ZeRO (Rajbhandari et al., 2019, https://arxiv.org/abs/1910.02054) observes that data parallelism keeps
N identical copies of the optimizer state, the gradients and the parameters, and removes them in
stages: optimizer state (ZeRO-1, "P_os"), gradients (ZeRO-2, "P_os+g"), parameters (ZeRO-3, "P_os+g+p",
which PyTorch calls FSDP; see fsdp.py).

Each FSDP unit (a layer, or a transformer sub-block) keeps its parameters in one flat buffer, padded
so it splits into ``world_size`` equal shards, as FSDP1's FlatParameter does. A rank's state per unit:

- ``flat``:   the full flat parameters in the compute dtype; module parameters are views into it.
- ``shard``:  this rank's slice of them (a view of ``flat``; a separate tensor under ZeRO-3).
- ``grad``:   the gradient: full (DP, ZeRO-1) or only this rank's shard (ZeRO-2, ZeRO-3).
- ``master``: the fp32 values this rank's optimizer updates: all of them (DP) or its shard. In fp32
              training it *is* ``shard``; with mixed precision it is a separate fp32 copy.
- ``state``:  the optimizer state (Adam's two moments, or SGD's momentum), shaped like ``master``.

Everything a strategy does between backward and the next forward is one ``*_step(unit, ctx)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .memory import held_bytes
from .timeline import span

# -- the flat parameter layout ----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSlice:
    """Elements ``[param_start, param_start + length)`` of parameter ``param`` (flattened) sit at
    ``[shard_start, shard_start + length)`` of a rank's shard."""
    param: int
    param_start: int
    shard_start: int
    length: int


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

    def shard_slices(self, rank: int) -> list[ShardSlice]:
        start, end = self.shard_bounds(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                out.append(ShardSlice(i, lo - off, lo - start, hi - lo))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view into ``flat`` (the full buffer)."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def flatten(self, tensors, dtype=None) -> torch.Tensor:
        """Copy ``tensors`` (shaped like the parameters) into a new padded flat buffer."""
        flat = torch.zeros(self.padded_numel, dtype=dtype or tensors[0].dtype)
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat


def layout_figure(layout: FlatLayout, names=None, title=None):
    """The flat buffer as one bar: each parameter's elements in its colour, padding grey, and the
    shard boundaries as lines labelled with the rank that owns the shard."""
    import plotly.graph_objects as go

    names = names or [f"param {i} {tuple(s)}" for i, s in enumerate(layout.shapes)]
    fig = go.Figure()
    for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
        fig.add_bar(x=[n], base=[off], y=["flat buffer"], orientation="h", name=names[i],
                    hovertemplate=f"{names[i]}: elements {off}..{off + n - 1}<extra></extra>")
    pad = layout.padded_numel - layout.numel
    if pad:
        fig.add_bar(x=[pad], base=[layout.numel], y=["flat buffer"], orientation="h", name="padding",
                    marker_color="lightgrey", hovertemplate=f"padding: {pad} zeros<extra></extra>")
    for r in range(layout.world_size):
        start, end = layout.shard_bounds(r)
        fig.add_vline(x=start, line_color="black", line_width=2)
        fig.add_annotation(x=(start + end) / 2, y=1.0, yref="paper", yanchor="bottom", text=f"rank {r}",
                           showarrow=False)
    fig.add_vline(x=layout.padded_numel, line_color="black", line_width=2)
    fig.update_layout(barmode="overlay", height=240, margin=dict(t=70, b=40), xaxis_title="element",
                      title=title or f"{layout.numel} elements, padded to {layout.padded_numel}: "
                                     f"{layout.world_size} shards of {layout.shard_numel}",
                      legend=dict(orientation="h", y=-0.6))
    return fig


# -- the models and their data ------------------------------------------------------------------------
class Attention(nn.Module):
    """Pre-norm self-attention sub-block with a residual: x + proj(attn(ln(x)))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.ln, self.qkv, self.proj = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):                                             # (B, T, d)
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, heads, T, d/heads)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, d))


class FeedForward(nn.Module):
    """Pre-norm MLP sub-block with a residual: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


# Sizes are deliberately odd, so no unit splits evenly and padding is exercised.
MODELS = {
    "mlp": dict(x=(4, 13), y=(4, 7)),
    "transformer": dict(x=(3, 6, 24), y=(3, 6, 24)),
}


def build_model(name: str, seed: int = 0) -> nn.Sequential:
    """The same initial weights on every rank and in the single-process reference. Each child of the
    returned Sequential is one unit: the granularity at which ZeRO-3 gathers and frees."""
    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(nn.Sequential(nn.Linear(13, 37), nn.ReLU()),
                             nn.Sequential(nn.Linear(37, 37), nn.ReLU()), nn.Linear(37, 7))
    if name == "transformer":
        return nn.Sequential(Attention(24, 3), FeedForward(24))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: different on every rank and step, the same every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    shapes = MODELS[name]
    return torch.randn(shapes["x"], generator=g), torch.randn(shapes["y"], generator=g)


def loss_fn(out, y):
    return F.mse_loss(out.float(), y)


# -- optimizers on flat fp32 tensors -------------------------------------------------------------------
@dataclass(frozen=True)
class Optimizer:
    """Element-wise, so updating a shard gives exactly the slice of updating the whole."""
    name: str = "sgd"        # "sgd" (with momentum) or "adam"
    lr: float = 0.05
    momentum: float = 0.9
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8

    def init_state(self, master: torch.Tensor) -> dict:
        if self.name == "sgd":
            return {"momentum": torch.zeros_like(master)}
        return {"exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master), "step": 0}

    def update(self, master: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        grad = grad.float()
        if self.name == "sgd":  # torch.optim.SGD, dampening 0: buf = m*buf + g; p -= lr*buf
            buf = state["momentum"]
            buf.mul_(self.momentum).add_(grad)
            master.add_(buf, alpha=-self.lr)
            return
        b1, b2 = self.betas  # torch.optim.Adam
        state["step"] += 1
        state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (state["exp_avg_sq"] / (1 - b2 ** state["step"])).sqrt_().add_(self.eps)
        master.addcdiv_(state["exp_avg"], denom, value=-self.lr / (1 - b1 ** state["step"]))


# -- a rank's state and the strategies --------------------------------------------------------------------
STAGES = ("dp", "zero1", "zero2", "zero3")


@dataclass
class Unit:
    module: nn.Module
    layout: FlatLayout
    flat: torch.Tensor
    shard: torch.Tensor
    master: torch.Tensor
    state: dict
    grad: torch.Tensor | None = None


@dataclass
class Context:
    """What a strategy's step needs besides the unit: who we are, and the optimizer."""
    rank: int
    world_size: int
    optimizer: Optimizer
    stage: str

    def update(self, unit: Unit, grad: torch.Tensor) -> None:
        """Optimizer step on ``unit.master`` with ``grad`` (same size); refresh ``unit.shard`` from it."""
        if grad.numel() != unit.master.numel():
            raise ValueError(f"ctx.update got a gradient of {grad.numel()} elements, but this rank updates "
                             f"{unit.master.numel()} values (its shard): pass the part of the gradient that "
                             f"matches this rank's shard, unit.grad[start:end] with start, end = "
                             f"unit.layout.shard_bounds(ctx.rank)")
        self.optimizer.update(unit.master, grad, unit.state)
        if unit.master.data_ptr() != unit.shard.data_ptr():  # mixed precision: fp32 master -> bf16 shard
            unit.shard.copy_(unit.master)


def setup(model: nn.Sequential, stage: str, rank: int, world_size: int, optimizer: Optimizer,
          dtype=torch.float32) -> list[Unit]:
    """Move each unit's parameters into a flat buffer and keep what ``stage`` keeps on this rank."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose from {', '.join(STAGES)}")
    units = []
    for module in model:
        params = list(module.parameters())
        # Replicated DP needs no padding: every rank holds everything.
        layout = FlatLayout.of(params, 1 if stage == "dp" else world_size)
        flat = layout.flatten([p.detach() for p in params], dtype)
        for p, view in zip(params, layout.views(flat)):
            p.data = view  # the module computes with views into the flat buffer
        start, end = layout.shard_bounds(0 if stage == "dp" else rank)
        shard = flat[start:end]
        if stage == "zero3":  # only the shard persists; flat is a gather buffer, freed between uses
            shard = shard.clone()
            flat.untyped_storage().resize_(0)
        master = shard if dtype == torch.float32 else shard.float()
        units.append(Unit(module, layout, flat, shard, master, optimizer.init_state(master)))
    return units


def flat_grad(unit: Unit) -> torch.Tensor:
    """The unit's parameter gradients in one padded flat buffer; the per-parameter grads are freed."""
    params = list(unit.module.parameters())
    grad = unit.layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    for p in params:
        p.grad = None
    return grad


def dp_step(unit: Unit, ctx: Context) -> None:
    """Replicated data parallelism: every rank averages the full gradient and updates everything."""
    comm.all_reduce(unit.grad, name="all_reduce grads")  # sum over ranks...
    unit.grad /= ctx.world_size                           # ...so divide for the mean
    ctx.update(unit, unit.grad)


def zero1_step(unit: Unit, ctx: Context) -> None:
    """ZeRO-1: the full gradient everywhere, but each rank updates (and keeps optimizer state for) only
    its shard, then the updated shards are gathered so every rank has all parameters again."""
    comm.all_reduce(unit.grad, name="all_reduce grads")
    unit.grad /= ctx.world_size
    start, end = unit.layout.shard_bounds(ctx.rank)
    ctx.update(unit, unit.grad[start:end])
    comm.all_gather(unit.flat, unit.shard, name="all_gather params")


def zero2_step(unit: Unit, ctx: Context) -> None:
    """ZeRO-2: reduce-scatter leaves each rank the summed gradient of its shard only; the full gradient
    is dropped. Then as ZeRO-1: update the shard, gather the parameters."""
    shard_grad = torch.empty(unit.layout.shard_numel, dtype=unit.grad.dtype)
    comm.reduce_scatter(shard_grad, unit.grad, name="reduce_scatter grads")
    unit.grad = shard_grad / ctx.world_size
    ctx.update(unit, unit.grad)
    comm.all_gather(unit.flat, unit.shard, name="all_gather params")


# -- training, and the single-process reference ----------------------------------------------------
def train(stage: str, model_name: str = "mlp", steps: int = 3, optimizer: Optimizer = Optimizer(),
          mixed: bool = False, step_fn=None, unshard=None, reshard=None) -> dict:
    """Train on this rank (inside ``cluster.run``) with one strategy; every rank sees its own batches.

    ``step_fn`` replaces the stage's library step (dp/zero1/zero2), ``unshard``/``reshard`` ZeRO-3's,
    so a learner's version runs in the same harness. Returns the full fp32 parameters per unit
    (gathered, unpadded), the bytes held by kind after the last step, and the losses."""
    import torch.distributed as dist

    from . import fsdp

    rank, n = dist.get_rank(), dist.get_world_size()
    ctx = Context(rank, n, optimizer, stage)
    units = setup(build_model(model_name), stage, rank, n, optimizer, torch.bfloat16 if mixed else torch.float32)
    step_fn = step_fn or {"dp": dp_step, "zero1": zero1_step, "zero2": zero2_step}.get(stage)
    # Start the steps together (untraced): otherwise the first collective absorbs the ranks' uneven
    # set-up time and looks like slow communication on the timeline.
    dist.barrier()
    losses = []
    for step in range(steps):
        x, y = batch(model_name, step, rank)
        if mixed:
            x = x.to(torch.bfloat16)
        if stage == "zero3":
            loss = fsdp.forward_backward(units, x, y, ctx, unshard or fsdp.unshard, reshard or fsdp.reshard)
            for u in units:
                ctx.update(u, u.grad)
        else:
            with span(f"fwd+bwd step {step}"):
                loss = loss_fn(nn.Sequential(*[u.module for u in units])(x), y)
                loss.backward()
            for u in units:
                u.grad = flat_grad(u)
                step_fn(u, ctx)
        losses.append(loss.item())
    memory = held_bytes(units)
    return {"params": gather_full(units, ctx), "memory": memory, "losses": losses,
            "psi": sum(u.layout.padded_numel for u in units)}


def gather_full(units: list[Unit], ctx: Context) -> list[torch.Tensor]:
    """Every unit's full fp32 parameters (unpadded), whatever the stage kept: for checking only, so
    the gather is not traced (it is no part of a training step)."""
    out = []
    for u in units:
        full = u.master
        if ctx.stage != "dp":
            full = torch.empty(u.layout.padded_numel, dtype=u.master.dtype)
            comm.all_gather_single(full, u.master.contiguous())
        out.append(full[:u.layout.numel].float().clone())
    return out


def reference(model_name: str = "mlp", steps: int = 3, world_size: int = 2,
              optimizer: Optimizer = Optimizer()) -> list[torch.Tensor]:
    """One process, the whole batch (every rank's micro-batch), the same optimizer: what every strategy
    must reproduce. Returns the full fp32 parameters per unit, flattened."""
    units = setup(build_model(model_name), "dp", 0, 1, optimizer)
    model = nn.Sequential(*[u.module for u in units])
    for step in range(steps):
        xs, ys = zip(*(batch(model_name, step, r) for r in range(world_size)))
        loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
        for u in units:
            optimizer.update(u.master, flat_grad(u), u.state)
    return [u.master[:u.layout.numel].clone() for u in units]
