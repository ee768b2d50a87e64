"""Lab 04's references, on the ranks: PyTorch's own tensor parallelism (DTensor's ``ColwiseParallel``,
``RowwiseParallel`` and ``SequenceParallel`` on a device mesh) on the lab's layers, and the checks' jobs:
each builds the lab's layers (``toy``) from a seed, runs a learner's pieces forward and backward on
every rank and returns plain results (outputs, gradients, the collectives issued), with DTensor's on the
same weights beside them, for the checks to judge against a single-process reference."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from .. import comm
from ..comm import to_device
from ..toy import FFN, HEADS, WIDTH, Attention, FeedForward, generator, seeded
from .prefetch import start_recording, step_times
from .tensor_parallel import WIDE, Fns, _rank, block_job, leaves, wide_block


# -- the checks' jobs ----------------------------------------------------------------------
B, T = 3, 8  # a check's batch: 3 sequences of 8 tokens (T divides by 2 and 4 for sequence parallelism)


def layers(seed: int = 0):
    """The feed-forward and attention sub-blocks of the lab's transformer block (``toy``)."""
    with seeded(seed):
        return FeedForward(), Attention()


def inputs(seed: int, *shape):
    g = generator(7 + 1_000_003 * seed)
    return torch.randn(shape, generator=g), torch.randn(shape[:-1] + (FFN,), generator=g), torch.randn(shape, generator=g)


def _grads(*ts):
    return [None if t.grad is None else t.grad.detach().clone() for t in ts]


def split_job(shard_column, shard_row, row_linear, seed=None) -> dict:
    """Task 4.1: fc1 split by columns (forward, and its weights' gradients), fc2 by rows (forward)."""
    r, n = _rank()
    ff, _ = to_device(*layers(seed or 0))
    x, dy, _ = to_device(*inputs(seed or 0, B, T, WIDTH))
    w1, b1 = shard_column(ff.fc1.weight.detach(), ff.fc1.bias.detach(), r, n)
    w2, b2 = shard_row(ff.fc2.weight.detach(), ff.fc2.bias.detach(), r, n)
    out = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    if not _fits(w1, b1, (FFN // n, WIDTH), FFN // n) or not _fits(w2, b2, (WIDTH, FFN // n), WIDTH):
        return out  # the check names the wrong shard: running the layers would only fail
    lw1, lb1 = leaves(w1, b1)
    y = F.linear(x, lw1, lb1)
    (y * dy.chunk(n, -1)[r]).sum().backward()
    out.update(column=y.detach(), column_grads=_grads(lw1, lb1))
    h = F.gelu(ff.fc1(x)).detach().chunk(n, -1)[r]   # this rank's slice of fc2's input
    with torch.no_grad():
        out["row"], out["row_ops"] = comm.watched(row_linear, h, w2, b2)
    return out


def _shards(shard: dict) -> dict:
    """This rank's given shards (its own only: the check sends them as a PerRank), on its device."""
    return {k: to_device(*v) for k, v in shard.items()}


def _fits(w, b, shape, bias) -> bool:
    return (isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor) and tuple(w.shape) == shape
            and tuple(b.shape) == (bias,))


def _run(fn, args, grad_out, leaves_):
    y, fwd = comm.watched(fn, *args)
    if not isinstance(y, torch.Tensor) or y.shape != grad_out.shape:
        return {"out": y if isinstance(y, torch.Tensor) else None, "fwd": fwd}
    _, bwd = comm.watched(lambda: (y * grad_out).sum().backward())
    return {"out": y.detach(), "fwd": fwd, "bwd": bwd, "grads": _grads(*leaves_)}


def mlp_job(tp_mlp, shard, seed=None, dtensor=True) -> dict:
    """Task 4.2: the MLP (fc1, GELU, fc2) column- then row-parallel, forward and backward. ``shard``: this
    rank's shards of the layers (given: lablib's answers to Task 4.1 are not on the ranks when grading)."""
    ff, _ = to_device(*layers(seed or 0))
    x, _, dy = to_device(*inputs(seed or 0, B, T, WIDTH))
    mine = _shards(shard)
    params = leaves(x, *mine["fc1"], *mine["fc2"])
    out = _run(tp_mlp, params, dy, params)
    if dtensor:
        out["dtensor"] = dtensor_mlp(ff, x, dy)
    return out


def attention_job(shard_qkv, tp_attention, shard, seed=None, dtensor=True) -> dict:
    """Task 4.3: attention split by heads, forward and backward (``shard``: as ``mlp_job``'s)."""
    r, n = _rank()
    _, att = to_device(*layers(seed or 0))
    x, _, dy = to_device(*inputs(seed or 0, B, T, WIDTH))
    wqkv, bqkv = shard_qkv(att.qkv.weight.detach(), att.qkv.bias.detach(), r, n)
    out = {"wqkv": wqkv, "bqkv": bqkv}
    rows = 3 * WIDTH // n
    if not all(isinstance(t, torch.Tensor) for t in (wqkv, bqkv)) or (tuple(wqkv.shape), tuple(bqkv.shape)) != \
            ((rows, WIDTH), (rows,)):
        return out  # the judge names the shard's shape; tp_attention would only fail on it
    params = leaves(x, wqkv, bqkv, *_shards(shard)["proj"])
    out.update(_run(tp_attention, params + [HEADS // n], dy, params))
    if dtensor:
        out["dtensor"] = dtensor_attention(att, x, dy)
    return out


def sp_job(sp_feed_forward, shard, seed=None, dtensor=True) -> dict:
    """Task 4.4: the feed-forward sub-block with sequence parallelism; (T, B, d) split along T (``shard``:
    as ``mlp_job``'s)."""
    r, n = _rank()
    ff, _ = to_device(*layers(seed or 0))
    x, _, dy = to_device(*inputs(seed or 0, T, B, WIDTH))
    mine = _shards(shard)
    params = leaves(x.chunk(n)[r], ff.ln.weight, ff.ln.bias, *mine["fc1"], *mine["fc2"])
    out = _run(sp_feed_forward, params, dy.chunk(n)[r], params)
    grads = out.get("grads", [])
    for i in (1, 2, 6):  # LayerNorm's and fc2's bias saw this rank's tokens only: their gradients sum over ranks
        if i < len(grads) and grads[i] is not None:
            dist.all_reduce(grads[i])
    if dtensor:
        out["dtensor"] = dtensor_sp(ff, x, dy)
    return out


# -- PyTorch's own: DTensor tensor parallelism on a CPU (or GPU) device mesh ------------------------------
_MESH = {}


def mesh():
    n = dist.get_world_size()
    if n not in _MESH:
        from torch.distributed.device_mesh import init_device_mesh
        _MESH[n] = init_device_mesh(comm.torch_device().type, (n,))
    return _MESH[n]


class MLP(nn.Module):
    """fc1, GELU, fc2: the feed-forward sub-block without its LayerNorm and residual."""

    def __init__(self, ff: FeedForward):
        super().__init__()
        self.fc1, self.fc2 = skip_init(nn.Linear, WIDTH, FFN), skip_init(nn.Linear, FFN, WIDTH)
        self.load_state_dict({k: v for k, v in ff.state_dict().items() if k.startswith("fc")})

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SplitQKV(nn.Module):
    """Attention without LayerNorm and residual, with Q, K and V as three layers (torchtitan's layout):
    ``ColwiseParallel`` splits a layer's rows in contiguous blocks, which for the fused layer would
    give rank 0 all of Q instead of its heads."""

    def __init__(self, att: Attention):
        super().__init__()
        self.q, self.k, self.v = (skip_init(nn.Linear, WIDTH, WIDTH) for _ in range(3))
        self.proj = skip_init(nn.Linear, WIDTH, WIDTH)
        with torch.no_grad():
            for layer, w, b in zip((self.q, self.k, self.v), att.qkv.weight.chunk(3), att.qkv.bias.chunk(3)):
                layer.weight.copy_(w)
                layer.bias.copy_(b)
        self.proj.load_state_dict(att.proj.state_dict())

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (layer(x).view(B, T, -1, WIDTH // HEADS).transpose(1, 2) for layer in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def _dtensor_run(model, x, dy, names):
    """DTensor's run on ``comm.torch_device()`` (this rank's GPU under NCCL, else the CPU)."""
    dev = comm.torch_device()
    model, x, dy = model.to(dev), x.detach().to(dev).clone().requires_grad_(), dy.to(dev)
    y = model(x)
    (y * dy).sum().backward()
    grads = [getattr(model.get_submodule(m), p).grad for m, p in names]
    return {"out": _plain(y), "x": _plain(x.grad), "grads": [_plain(g.to_local() if hasattr(g, "to_local") else g)
                                                           for g in grads]}


def _plain(t):
    """A plain tensor: DTensor hands back its outputs as AsyncCollectiveTensors (a subclass, waited for on
    first use), which a check's data may not hold."""
    t = t.wait() if hasattr(t, "wait") else t
    return torch.Tensor(t.detach()).clone() if type(t) is not torch.Tensor else t.detach().clone()


def dtensor_mlp(ff, x, dy):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = parallelize_module(MLP(ff).to(comm.torch_device()), mesh(), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return _dtensor_run(model, x, dy, [("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")])


def dtensor_attention(att, x, dy):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = parallelize_module(SplitQKV(att).to(comm.torch_device()), mesh(), {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                                       "v": ColwiseParallel(), "proj": RowwiseParallel()})
    return _dtensor_run(model, x, dy, [("q", "weight"), ("k", "weight"), ("v", "weight"), ("proj", "weight")])


def dtensor_sp(ff, x, dy):
    """The feed-forward sub-block with ``SequenceParallel`` on the LayerNorm (sequence dim 0); each rank
    feeds and gets its part of the sequence."""
    import copy

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    r, n = _rank()
    model = parallelize_module(copy.deepcopy(ff).to(comm.torch_device()), mesh(), {"ln": SequenceParallel(sequence_dim=0),
                                                            "fc1": ColwiseParallel(input_layouts=Shard(0)),
                                                            "fc2": RowwiseParallel(output_layouts=Shard(0))})
    out = _dtensor_run(model, x.chunk(n)[r], dy.chunk(n)[r], [("ln", "weight"), ("fc1", "weight")])
    out["grads"][0] = _plain(model.ln.weight.grad.full_tensor())
    return out


def dtensor_block_job(steps: int = 3, warmup: int = 1, seed: int = 0) -> dict:
    """The same block with DTensor: ``SplitQKV``-style Q/K/V and fc1 colwise, proj and fc2 rowwise."""
    import time

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    att, ff = wide_block(seed)
    d, heads = WIDE["d"], WIDE["heads"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2, self.ff = att.ln, ff.ln, ff
            self.q, self.k, self.v = (skip_init(nn.Linear, d, d) for _ in range(3))
            self.proj = att.proj
            with torch.no_grad():
                for layer, w, b in zip((self.q, self.k, self.v), att.qkv.weight.chunk(3), att.qkv.bias.chunk(3)):
                    layer.weight.copy_(w)
                    layer.bias.copy_(b)

        def forward(self, x):
            B_, T_, _ = x.shape
            u = self.ln1(x)
            q, k, v = (f(u).view(B_, T_, -1, d // heads).transpose(1, 2) for f in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.proj(y.transpose(1, 2).reshape(B_, T_, -1))
            return h + self.ff.fc2(F.gelu(self.ff.fc1(self.ff.ln(h))))

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
            "ff.fc1": ColwiseParallel(), "ff.fc2": RowwiseParallel()}
    dev = comm.torch_device()
    model = parallelize_module(Block().to(dev), mesh(), plan)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(WIDE["batch"], WIDE["tokens"], d, generator=g).to(dev)
    seconds = []
    for step in range(warmup + steps):
        if step == warmup:
            start_recording()
        t0 = time.perf_counter()
        model(x.clone().requires_grad_()).sum().backward()
        comm.synchronize()
        seconds.append(time.perf_counter() - t0)
    return {"seconds": seconds[warmup:]}


def measure(cluster, fns: Fns, degrees=(1, 2, 4), steps: int | None = None) -> dict:
    """The wide block at each tensor-parallel degree (a pool of that size: ``cluster`` where it matches,
    else ``lablib.pool.spare``'s), ``steps`` timed steps (5, or 2 under LABLIB_QUICK) after a warm-up: {degree: step time (median
    over steps of the slowest rank) and its range, DTensor's on the same pool, the timeline of the
    recorded steps, whether DTensor computed on the CPU while the block ran on GPUs (ranks sharing GPUs over
    Gloo: ``comm.torch_device``)}."""
    from ..paths import quick
    from ..pool import spare
    from ..pool.backend import torch_on_cpu

    steps = steps or (2 if quick() else 5)
    out = {}
    for n in degrees:
        pool = cluster if n == cluster.world_size else spare(n, "gloo" if cluster.backend == "gloo" else "auto", device=cluster.device)
        dtensor = step_times(pool.run(dtensor_block_job, steps))
        times = step_times(pool.run(block_job, fns, steps))
        out[n] = {"step": statistics.median(times), "range": (min(times), max(times)),
                  "dtensor": statistics.median(dtensor), "dtensor_range": (min(dtensor), max(dtensor)),
                  "timeline": pool.timeline(), "steps": steps,
                  "apart": torch_on_cpu(pool.backend, pool.device)}
    return out
