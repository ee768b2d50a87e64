"""Tensor (intra-layer) parallelism after Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053, section 3),
and sequence parallelism after Korthikanti et al. (2022, arXiv:2205.05198, section 4.2.2).

A linear layer Y = X A splits two ways (torch keeps A transposed: ``weight`` is (out, in)):
- column-parallel: A by its columns, the output features (``weight``'s rows); rank r computes its slice
  of Y from the whole X, and keeps its slice of the bias;
- row-parallel: A by its rows, the input features (``weight``'s columns); rank r multiplies its slice of
  X, a partial sum of Y; an all-reduce adds the partial sums; the bias is added once, after it.
Column then row needs no communication in between, so an MLP costs one all-reduce in the forward (g)
and one in the backward (f). Attention splits by heads: Q, K and V column-parallel, the output
projection row-parallel. Sequence parallelism splits the sequence outside those regions (LayerNorm,
residual): g becomes a reduce-scatter along the sequence, f an all-gather.

This file is the measured block, run with a learner's functions or lablib's (``lablib.answers.lab04``,
where the learner's are not checked yet, and in the benchmark). The checks' jobs and PyTorch's DTensor
on the same layers are in tp_reference.py.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..timeline import RECORDER, RawSpan, _now
from ..toy import Attention, FeedForward, seeded
from .prefetch import start_recording


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _rank():
    return dist.get_rank(), dist.get_world_size()


# -- measured: a tensor-parallel transformer block ---------------------------------------------------------
class Fns:
    """The functions a block runs: the learner's where checked (``yours`` in lab 04's checks), else
    lablib's (``lablib.answers.lab04.FNS``): how it is split (``shard_column``, ``shard_row``,
    ``shard_qkv``) and run (``mlp``, ``attention``, ``sp``)."""

    def __init__(self, mlp, attention, sp, shard_column, shard_row, shard_qkv):
        self.mlp, self.attention, self.sp = mlp, attention, sp
        self.shard_column, self.shard_row, self.shard_qkv = shard_column, shard_row, shard_qkv


WIDE = dict(d=256, heads=8, ffn=1024, batch=4, tokens=128)  # measured block: 4 x 128 tokens, width 256


def wide_block(seed: int = 0):
    with seeded(seed):
        return Attention(WIDE["d"], WIDE["heads"]), FeedForward(WIDE["d"], WIDE["ffn"])


def _cut_at_comm(spans: list) -> list:
    """A rank that waits in a synchronous collective is not computing: cut the compute spans around
    the comm spans inside them."""
    comms = sorted((s.t0, s.t1) for s in spans if s.kind == "comm")
    out = []
    for s in spans:
        if s.kind != "compute":
            out.append(s)
            continue
        t = s.t0
        for c0, c1 in comms:
            if c1 <= t or c0 >= s.t1:
                continue
            if c0 > t:
                out.append(s._replace(t0=t, t1=c0))
            t = max(t, c1)
        if t < s.t1:
            out.append(s._replace(t0=t))
    return out


def block_job(fns: Fns, steps: int = 3, warmup: int = 1, seed: int = 0) -> dict:
    """Forward and backward of the wide transformer block, tensor-parallel over all ranks, with the
    learner's (or lablib's) functions; recorded after ``warmup`` steps, with a compute span per
    sub-block and pass, cut where the rank waits in a collective. Returns each recorded step's seconds."""
    r, n = _rank()
    att, ff = comm.to_device(*wide_block(seed))
    heads = WIDE["heads"] // n
    a = leaves(*fns.shard_qkv(att.qkv.weight, att.qkv.bias, r, n), *fns.shard_row(att.proj.weight, att.proj.bias, r, n))
    m = leaves(*fns.shard_column(ff.fc1.weight, ff.fc1.bias, r, n), *fns.shard_row(ff.fc2.weight, ff.fc2.bias, r, n))
    x = comm.to_device(torch.randn(WIDE["batch"], WIDE["tokens"], WIDE["d"], generator=torch.Generator().manual_seed(seed)))
    seconds = []
    for step in range(warmup + steps):
        if step == warmup:
            start_recording()
        marks = {"F attn": _now()}
        xs = x.clone().requires_grad_()
        h = xs + fns.attention(att.ln(xs), *a, heads)
        marks["F mlp"] = _now()
        out = h + fns.mlp(ff.ln(h), *m)
        marks["B mlp"] = _now()
        h.register_hook(lambda grad: marks.setdefault("B attn", _now()) and None)  # h's gradient is whole: mlp's done
        out.sum().backward()
        comm.synchronize()
        end = _now()
        if step >= warmup and RECORDER.spans is not None:
            names = list(marks)
            RECORDER.spans.extend(RawSpan(name, "compute", marks[name], marks[names[i + 1]] if i + 1 < len(names) else end,
                                          0, None, False, {"op": "forward" if name[0] == "F" else "backward"})
                                  for i, name in enumerate(names))
        seconds.append((end - marks["F attn"]) / 1e9)
    if RECORDER.spans is not None:
        RECORDER.spans[:] = _cut_at_comm(RECORDER.spans)
    return {"seconds": seconds[warmup:], "tokens": WIDE["batch"] * WIDE["tokens"]}


def saved_bytes(fn, *args, params=()) -> int:
    """Bytes of the distinct tensors autograd saves for the backward while ``fn(*args)`` runs forward,
    less ``params``' (weights are not activations): the activation memory held until the backward."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def activation_bytes(mode: str, fns: Fns, seed: int = 0) -> int:
    """On this rank: the activation bytes the wide block's feed-forward sub-block saves for its backward,
    tensor-parallel ("tp": LayerNorm and residual on the whole sequence, ``fns.mlp``) or with sequence
    parallelism ("sp": on this rank's part, ``fns.sp``)."""
    r, n = _rank()
    _, ff = comm.to_device(*wide_block(seed))
    x = comm.to_device(torch.randn(WIDE["tokens"], WIDE["batch"], WIDE["d"], generator=torch.Generator().manual_seed(seed)))
    weights = leaves(ff.ln.weight, ff.ln.bias, *fns.shard_column(ff.fc1.weight, ff.fc1.bias, r, n),
                     *fns.shard_row(ff.fc2.weight, ff.fc2.bias, r, n))
    if mode == "sp":
        return saved_bytes(fns.sp, leaves(x.chunk(n)[r])[0], *weights, params=weights)
    ln_w, ln_b, *fc = weights
    x = leaves(x)[0]
    return saved_bytes(lambda: x + fns.mlp(F.layer_norm(x, x.shape[-1:], ln_w, ln_b), *fc), params=weights)

