"""The course's models and their data: small enough for 2 CPU cores, shaped like the real thing.

- ``mlp``: 13 -> 37 -> 37 -> 7. Its units hold 518, 1406 and 266 parameters: none divides by 3 or 4,
  so sharding it over 3 or 4 ranks needs padding (lab 01 draws and checks that).
- ``transformer``: one pre-norm block (attention, then feed-forward), width 32, 4 heads, feed-forward
  width 128: every split dimension divides by 2 and 4, so tensor parallelism can split heads and
  the feed-forward over 2 or 4 ranks. Its units (4288 and 8416 parameters) divide by 2 and 4 but not
  by 3, so 3 ranks pad.
- ``transformer8``: 8 such blocks, 16 units, for 2- and 4-stage pipelines.
- ``wide8``: 8 layers 512 -> 512 (GELU), 262,656 parameters each, on micro-batches of 512: enough
  compute per layer on a CPU core to hide a layer's all-gather behind (lab 03).

Every rank builds the same initial weights (a fixed seed) and draws its own micro-batch per step, the
same every run, so a distributed run can be compared with a single-process reference.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, FFN = 32, 4, 128


class Attention(nn.Module):
    """Pre-norm self-attention sub-block with a residual: x + proj(attn(ln(x)))."""

    def __init__(self, d: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.heads, self.ln, self.qkv, self.proj = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):                                             # (B, T, d)
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, heads, T, d/heads)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, d))


class FeedForward(nn.Module):
    """Pre-norm MLP sub-block with a residual: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, d: int = WIDTH, ffn: int = FFN):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


# Shapes of one rank's micro-batch: inputs and targets.
MODELS = {
    "mlp": dict(x=(4, 13), y=(4, 7)),
    "transformer": dict(x=(3, 6, WIDTH), y=(3, 6, WIDTH)),
    "transformer8": dict(x=(3, 6, WIDTH), y=(3, 6, WIDTH)),
    "wide8": dict(x=(512, 512), y=(512, 512)),
}


_DRAWS = threading.RLock()


def draws():
    """Torch's global generator held by this thread while inside: the grader judges learners in threads
    (``lablib grade --jobs``), and a judge that builds a layer draws from that generator, seeded or not.
    A draw in another thread between two of ``seeded``'s would build other weights than the ranks did, so
    the grader runs each judge, and each check's given data, inside this (course/exercises.Call)."""
    return _DRAWS


@contextmanager
def seeded(seed: int):
    """Torch's global generator seeded with ``seed`` for what is built inside, one thread at a time
    (``draws``)."""
    with _DRAWS:
        torch.manual_seed(seed % (1 << 64))
        yield


def generator(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` taken into torch's 64 bits: a grading call's seed has 62
    (course/exercises.call_seed), and multiples of it (other weights per step, per rank) pass 64."""
    return torch.Generator().manual_seed(seed % (1 << 64))


def build_model(name: str, seed: int = 0) -> nn.Sequential:
    """The same initial weights on every rank and in the single-process reference. Each child of the
    returned Sequential is one unit: the granularity at which ZeRO-3 gathers and frees."""
    with seeded(seed):
        return _build(name)


def _build(name: str) -> nn.Sequential:
    if name == "mlp":
        return nn.Sequential(nn.Sequential(nn.Linear(13, 37), nn.ReLU()),
                             nn.Sequential(nn.Linear(37, 37), nn.ReLU()), nn.Linear(37, 7))
    if name == "wide8":
        return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)])
    if name.startswith("transformer") and name in MODELS:
        blocks = int(name[len("transformer"):] or 1)
        return nn.Sequential(*[unit for _ in range(blocks) for unit in (Attention(), FeedForward())])
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def batch(name: str, step: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at ``step``: different on every rank and step (and ``seed``: a grading
    draw), the same every run."""
    g = generator(1000 * step + rank + 1_000_003 * seed)
    shapes = MODELS[name]
    return torch.randn(shapes["x"], generator=g), torch.randn(shapes["y"], generator=g)


def loss_fn(out, y):
    return F.mse_loss(out.float(), y)
