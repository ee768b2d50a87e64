"""Lab 04's answers: Megatron's column and row splits, its f and g operators, the MLP and attention split
by heads, and sequence parallelism's f and g (the measured block that runs them is in
``strategies.tensor_parallel``; the checks' jobs in ``strategies.tp_reference``)."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from .. import comm
from ..strategies.tensor_parallel import Fns

TASKS = {"Task 4.1": ("shard_column", "shard_row", "row_linear"), "Task 4.2": ("Copy", "Reduce", "tp_mlp"),
         "Task 4.3": ("shard_qkv", "tp_attention"), "Task 4.4": ("Gather", "Scatter", "sp_feed_forward")}


def shard_column(weight, bias, rank, world_size):
    return weight.chunk(world_size, 0)[rank], bias.chunk(world_size, 0)[rank]


def shard_row(weight, bias, rank, world_size):
    return weight.chunk(world_size, 1)[rank], bias


def row_linear(x, weight, bias):
    y = F.linear(x, weight)
    comm.all_reduce(y)
    return y + bias


class Copy(Function):
    """Megatron's f: identity forward, all-reduce backward (over ``group``: the tensor-parallel ranks)."""
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class Reduce(Function):
    """Megatron's g: all-reduce forward, identity backward."""
    @staticmethod
    def forward(ctx, x, group=None):
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_mlp(x, w1, b1, w2, b2, group=None):
    """(..., d), whole on every rank -> (..., d), whole: fc1 column-parallel, fc2 row-parallel. ``group``:
    the tensor-parallel ranks (None: every rank)."""
    h = F.gelu(F.linear(Copy.apply(x, group), w1, b1))   # (..., ffn / n)
    return Reduce.apply(F.linear(h, w2), group) + b2


def shard_qkv(weight, bias, rank, world_size):
    """The fused (3d, d) projection's rows are [Q; K; V], each d = heads x head_dim: a rank takes its
    heads' rows from each of the three."""
    d_in = weight.shape[1]
    w = weight.view(3, world_size, -1, d_in)[:, rank].reshape(-1, d_in)
    return w, bias.view(3, world_size, -1)[:, rank].reshape(-1)


def tp_attention(x, wqkv, bqkv, wo, bo, heads, group=None):
    """(B, T, d), whole on every rank -> (B, T, d); ``heads``: this rank's heads."""
    B, T, _ = x.shape
    q, k, v = F.linear(Copy.apply(x, group), wqkv, bqkv).view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, heads, T, head_dim)
    return Reduce.apply(F.linear(y.transpose(1, 2).reshape(B, T, -1), wo), group) + bo


def _split0(x, group=None):
    return x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))


def _whole0(x, group=None):
    return x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))


class Gather(Function):
    """Sequence parallelism's f: all-gather along the sequence (dim 0) forward, reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        out = _whole0(x, group)
        comm.all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = _split0(grad, ctx.group)
        comm.reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


class Scatter(Function):
    """Sequence parallelism's g: reduce-scatter along the sequence (dim 0) forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        out = _split0(x, group)
        comm.reduce_scatter(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = _whole0(grad, ctx.group)
        comm.all_gather(out, grad.contiguous(), group=ctx.group)
        return out, None


def sp_feed_forward(x, ln_w, ln_b, w1, b1, w2, b2, group=None):
    """The feed-forward sub-block, x + fc2(gelu(fc1(ln(x)))), on this rank's part of the sequence:
    (T / n, B, d) -> (T / n, B, d)."""
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b), group)   # (T, B, d)
    h = F.gelu(F.linear(h, w1, b1))                                      # (T, B, ffn / n)
    return x + Scatter.apply(F.linear(h, w2), group) + b2


FNS = Fns(tp_mlp, tp_attention, sp_feed_forward, shard_column, shard_row, shard_qkv)


def shards(ff, att, world_size: int) -> list[dict]:
    """Per rank, the shards of the checks' layers (``tp_reference.layers``) that a task does not ask for:
    fc1 by columns, fc2 and the projection by rows. The checks' jobs take them as data (``Check.given``)."""
    out = []
    for r in range(world_size):
        w = {"fc1": shard_column(ff.fc1.weight.detach(), ff.fc1.bias.detach(), r, world_size),
             "fc2": shard_row(ff.fc2.weight.detach(), ff.fc2.bias.detach(), r, world_size),
             "proj": shard_row(att.proj.weight.detach(), att.proj.bias.detach(), r, world_size)}
        out.append({k: [t.clone() for t in v] for k, v in w.items()})
    return out
