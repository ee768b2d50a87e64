"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks (lab 07's harness).

A router scores each token against E experts; each token goes to its top k, and its output is its input
plus the gate-weighted sum of those experts' outputs (Shazeer et al. 2017, arXiv:1701.06538; Switch
Transformer, Fedus et al. 2021, arXiv:2101.03961; GShard, Lepikhin et al. 2020, arXiv:2006.16668). With
E/P experts on each of P ranks, a rank sends each token to the ranks of its experts and gets the results
back: two all-to-alls whose split sizes depend on the routing (Megatron-Core's ``MoEAlltoAllTokenDispatcher``,
torchtitan's MoE). Here: the layer's weights and tokens, one expert's feed-forward (``expert``), which
experts a rank holds, the all-gather dispatcher to compare with, and the measured and modelled costs.
The lab's answers are in ``lablib.answers.lab07``.
"""
from __future__ import annotations

import math

import torch

from ..timeline import noted, span
from ..toy import seeded

_ROWS: list = [None]  # the rows of each expert() call while a check holds a list here


def expert(x, w1, w2):
    """One expert's feed-forward on the tokens routed to it: relu(x @ w1) @ w2, x (tokens, dim), w1 (dim,
    hidden), w2 (hidden, dim). A span of its own on the timeline."""
    if _ROWS[0] is not None:
        _ROWS[0].append(x.shape[0])
    with span(f"expert {x.shape[0]} tokens", "compute"):
        return torch.relu(x @ w1) @ w2


def rows_of(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the number of tokens of every ``expert`` call meanwhile, in order."""
    return noted(_ROWS, fn, *args, **kwargs)


def layer(dim: int, hidden: int, experts: int, seed: int = 0) -> tuple:
    """The layer's weights, the same on every rank: router (dim, E), w1 (E, dim, hidden), w2 (E, hidden, dim)."""
    with seeded(seed):
        return (torch.randn(dim, experts) / math.sqrt(dim), torch.randn(experts, dim, hidden) / math.sqrt(dim),
                torch.randn(experts, hidden, dim) / math.sqrt(hidden))


def tokens(count: int, dim: int, router, seed: int = 0, skew: float = 0.0):
    """``count`` tokens (count, dim); ``skew`` pulls every token toward router column 0, so expert 0 is hot."""
    with seeded(1000 + seed):
        x = torch.randn(count, dim)
    return x + skew * router[:, 0] / router[:, 0].norm()


def local(w, rank: int, world_size: int):
    """The experts rank ``rank`` holds of w (E, ...): E/P consecutive ones, rank r's starting at r·E/P."""
    if w.shape[0] % world_size:
        raise ValueError(f"{w.shape[0]} experts do not split evenly over {world_size} ranks")
    return w.chunk(world_size)[rank]


def capacity(tokens_per_rank: int, k: int, capacity_factor: float, experts: int) -> int:
    """Assignments an expert takes from one rank: ⌈tokens × k × capacity factor / E⌉."""
    return math.ceil(tokens_per_rank * k * capacity_factor / experts)


# -- the all-gather dispatcher, the other way Megatron-Core ships -----------------------------------------
def allgather_moe(x, router, w1, w2, k: int, route):
    """Every rank gathers every rank's tokens (and routing), runs its own experts on those routed to them,
    and a reduce-scatter returns each rank the sum of the experts' outputs for its tokens. No counts to
    exchange, but every token crosses to every rank. ``route``: the router (Task 7.1's)."""
    import torch.distributed as dist

    from .. import comm

    rank, n = dist.get_rank(), dist.get_world_size()
    gates, chosen, _ = route(x, router, k)
    xs, gs, cs = (t.new_empty((n * t.shape[0],) + t.shape[1:]) for t in (x, gates, chosen))
    for out, t, what in zip((xs, gs, cs), (x, gates, chosen), ("tokens", "gates", "experts")):
        comm.all_gather(out, t.contiguous(), name=f"all_gather {what}")
    mixed = torch.zeros_like(xs)
    first = rank * w1.shape[0]
    for e in range(w1.shape[0]):
        token, slot = (cs == first + e).nonzero(as_tuple=True)
        mixed.index_add_(0, token, gs[token, slot, None] * expert(xs[token], w1[e], w2[e]))
    mine = torch.empty_like(x)
    comm.reduce_scatter(mine, mixed, name="reduce_scatter outputs")
    return x + mine


# -- measured: one layer on the ranks --------------------------------------------------------------------
BIG = dict(tokens=2048, dim=256, hidden=512, experts=8, k=2)  # per rank: 2048 tokens of 256


def moe_job(fn, skew: float = 0.0, steps: int = 2, link=None, dispatcher: str = "all_to_all", route=None,
            capacity_factor=None, **size) -> dict:
    """``steps`` forwards of the MoE layer ``fn(x, router, w1, w2, k[, capacity_factor])`` on this rank's ``BIG``
    tokens (``size`` overrides), after a warm-up; the timeline records the last. ``dispatcher="all_gather"``
    runs ``allgather_moe`` instead. ``link``: collectives over a simulated link. Returns each step's seconds,
    the CPU seconds this rank's thread spent in the last (its own work, whether or not it had a core to
    itself), the tokens each of this rank's experts computed, and the assignments this rank's tokens have on
    each rank (by ``route``, the router)."""
    import torch.distributed as dist

    from .. import comm
    from .prefetch import timed_steps

    r, n = dist.get_rank(), dist.get_world_size()
    s = {**BIG, **size}
    router, w1, w2 = layer(s["dim"], s["hidden"], s["experts"])
    x = tokens(s["tokens"], s["dim"], router, seed=r, skew=skew)
    x, router, w1, w2 = comm.to_device(x, router, local(w1, r, n), local(w2, r, n))
    extra = () if capacity_factor is None else (capacity_factor,)
    layer_fn, args = (allgather_moe, (route,)) if dispatcher == "all_gather" else (fn, extra)
    seconds, cpu, (_, rows) = timed_steps(steps, link, lambda: rows_of(layer_fn, x, router, w1, w2, s["k"], *args))
    to_rank = None
    if route is not None:
        chosen = route(x, router, s["k"])[1]
        to_rank = torch.bincount(chosen.flatten() // (s["experts"] // n), minlength=n).tolist()
    return {"seconds": seconds, "cpu": cpu, "rows": rows, "to_rank": to_rank}


def combine_wait(timeline, which: int = 2) -> list[float]:
    """Seconds each rank of a recorded forward waited in its ``which``-th all-to-all (2: the combine, after
    the counts and the dispatch) before data moved: from entering it until its last peer had."""
    from ..overlap import phases

    cut = phases(timeline.spans, timeline.world_size)
    out = []
    for r in range(timeline.world_size):
        mine = sorted((s for s in timeline.spans if s.rank == r and s.kind == "comm" and "to" in s.meta),
                      key=lambda s: s.start)
        out.append(cut[id(mine[which])][1] - mine[which].start if len(mine) > which else 0.0)
    return out


def dispatchers(cluster, fn, route, rounds: int | None = None, steps: int | None = None, **size) -> dict:
    """Both dispatchers on the even routing, one after the other, ``rounds`` times (3; 2 under LABLIB_QUICK)
    of ``steps`` timed layers each (3; 2), on the slowest rank: {name: {"steps": each round's seconds,
    "sent": bytes rank 0 sent in a layer}}. Alternating them spreads a busy moment of the machine over both.
    ``size`` overrides ``BIG``."""
    from .. import comm
    from ..paths import quick
    from .prefetch import step_times

    rounds, steps = rounds or (2 if quick() else 3), steps or (2 if quick() else 3)
    out = {name: {"steps": [], "sent": 0.0} for name in ("all_to_all", "all_gather")}
    for _ in range(rounds):
        for name, row in out.items():
            row["steps"].append(step_times(cluster.run(moe_job, fn, 0.0, steps, None, name, route, **size)))
            row["sent"] = comm.bytes_sent(cluster.timeline(), rank=0)
    return out


def balance_run(route, dense, balance_loss, alpha: float, steps: int = 100, skew: float = 2.0, experts: int = 8,
                k: int = 2, seed: int = 0, bias_rate: float | None = None) -> dict:
    """Train one layer in one process, ``steps`` Adam steps on a batch skewed toward expert 0: a regression to
    a fixed linear map, plus ``balance_loss(probs, experts, E, alpha)`` where alpha is not 0. Returns the
    assignments each expert got at every step (by ``route``, the router being trained), to watch the load
    even out, or not ("loads"), and the regression's own loss at the last step ("task_loss"). ``bias_rate``: DeepSeek-V3's way instead: a per-expert bias added to the probabilities
    to choose the experts (``dense(..., bias=)``), after each step raised by ``bias_rate`` for the experts
    below the mean load and lowered for those above."""
    router, w1, w2 = layer(32, 64, experts, seed=seed + 1)
    x = tokens(512, 32, router, seed=seed, skew=skew)
    with seeded(seed + 2):
        target = x @ torch.randn(32, 32) / math.sqrt(32)
    params = [t.clone().requires_grad_() for t in (router, w1, w2)]
    opt = torch.optim.Adam(params, lr=1e-2)
    bias = torch.zeros(experts) if bias_rate else None
    loads = []
    for _ in range(steps):
        _, chosen, probs = route(x, params[0], k)
        if bias is not None:
            chosen = (probs + bias).topk(k, dim=-1).indices
        load = torch.bincount(chosen.flatten(), minlength=experts)
        loads.append(load.tolist())
        out = dense(x, *params, k) if bias is None else dense(x, *params, k, bias=bias)
        loss = task = ((out - target) ** 2).mean()
        if alpha:
            loss = loss + balance_loss(probs, chosen, experts, alpha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bias is not None:
            bias += bias_rate * torch.sign(load.float().mean() - load)
    return {"loads": loads, "task_loss": task.item()}


def dense_seconds(fn, steps: int = 3, world_size: int = 4, **size) -> float:
    """One process, every expert: the best of ``steps`` timings of the dense reference ``fn(x, router, w1,
    w2, k)`` on the tokens of ``world_size`` ranks, as the benchmark's baseline."""
    import time

    s = {**BIG, **size}
    router, w1, w2 = layer(s["dim"], s["hidden"], s["experts"])
    x = torch.cat([tokens(s["tokens"], s["dim"], router, seed=r) for r in range(world_size)])
    best = math.inf
    for _ in range(steps):
        t0 = time.perf_counter()
        fn(x, router, w1, w2, s["k"])
        best = min(best, time.perf_counter() - t0)
    return best


def bytes_matrix(timeline, which: int = 1) -> list[list[int]]:
    """From a timeline: bytes[src][dst] each rank sent each rank in its ``which``-th all-to-all (in time
    order, from 0: 1 is a layer's dispatch, after the counts), as the spans recorded them."""
    n = timeline.world_size
    out = [[0] * n for _ in range(n)]
    for r in range(n):
        mine = sorted((s for s in timeline.spans if s.rank == r and s.kind == "comm" and "to" in s.meta),
                      key=lambda s: s.start)
        if len(mine) > which:
            out[r] = list(mine[which].meta["to"])
    return out


def modelled_dispatch(tokens_per_gpu: int, dim: int, k: int, gpus: int, link_bytes_per_s: float,
                      bytes_per_value: int = 2) -> float:
    """Seconds for one dispatch all-to-all, modelled: each GPU sends (P-1)/P of its k·tokens rows of ``dim``
    values (BF16) out, at ``link_bytes_per_s`` per GPU (the slowest link on the way), routing even."""
    return tokens_per_gpu * k * dim * bytes_per_value * (gpus - 1) / gpus / link_bytes_per_s


def modelled_experts(tokens_per_gpu: int, dim: int, hidden: int, k: int, flops_per_s: float) -> float:
    """Seconds of one GPU's expert compute, forward, modelled: each of its k·tokens assignments (even routing)
    through two matmuls, dim·hidden multiply-adds each, 2·dim·hidden FLOPs (a multiply-add is two), at
    ``flops_per_s``."""
    return tokens_per_gpu * k * 2 * (2 * dim * hidden) / flops_per_s


# Per-GPU, one direction, datasheet figures (the links an expert-parallel all-to-all crosses).
EP_LINKS = {
    "NVLink 4 (H100 SXM, within a node)": (450e9, "https://www.nvidia.com/en-us/data-center/h100/"),
    "InfiniBand NDR 400 Gb/s (one NIC per GPU, across nodes)": (50e9, "https://www.nvidia.com/en-us/networking/infiniband-adapters/"),
    "100 Gb/s Ethernet (one per GPU, across nodes)": (12.5e9, "IEEE 802.3 line rate / 8"),
}
