"""Which layout for a model on a cluster: every valid (DP, TP, PP, CP, micro-batches, recomputation), its
memory per GPU (the learner's formula, Task 8.4) and its step time (modelled here, every term stated), and
the fastest that fits.

Step time, per the labs: compute at an efficiency that falls as tensor parallelism narrows the matrices
(``efficiency``, a stated curve, not measured); tensor parallelism's all-reduces (lab 04: 4 a layer per
micro-batch, 6 with recomputation), exposed; the pipeline's 1F1B bubble (lab 05: (m + p - 1) micro-batch
times); context parallelism's K/V ring (lab 06), exposed; the data-parallel gradient reduction (lab 01) past
the last micro-batch's backward, which it overlaps. Collectives under lab 02's α-β model on datasheet
links, each axis placed inner to outer TP, CP, PP, DP (Llama 3's order): an axis whose group fits in a node
uses NVLink, any other the network. Not modelled: the embedding's and loss's compute, the pipeline's
sends, stage imbalance, interleaved schedules, kernels' launch overheads.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..comm import Link


class Model(NamedTuple):
    name: str
    layers: int
    hidden: int
    ffn: int            # the SwiGLU MLP's inner width
    heads: int
    kv_heads: int       # grouped-query attention: K and V have this many heads
    vocab: int

    def layer_params(self) -> int:
        """One transformer layer's parameters: Q and O (h × h each), K and V (h × h·kv/heads each), the SwiGLU
        MLP (3 × h × ffn); norms left out."""
        h = self.hidden
        return 2 * h * h + 2 * h * (h * self.kv_heads // self.heads) + 3 * h * self.ffn

    def params(self) -> int:
        """The whole model's: every layer, the embedding and the output layer (vocab × h each)."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden

    def stage_params(self, pp: int) -> int:
        """The parameters of the largest of ``pp`` pipeline stages, before tensor parallelism: ⌈layers / pp⌉
        layers, and the embedding (first stage) or the output layer (last); both when pp = 1."""
        return math.ceil(self.layers / pp) * self.layer_params() + self.vocab * self.hidden * (2 if pp == 1 else 1)


class GPU(NamedTuple):
    name: str
    memory: float       # bytes
    flops: float        # peak dense BF16 FLOP/s


class Cluster(NamedTuple):
    gpus: int
    per_node: int
    intra: Link
    inter: Link


class Layout(NamedTuple):
    dp: int
    tp: int
    pp: int
    cp: int
    micro_batches: int  # per data-parallel rank and step
    recompute: bool
    seq: int            # tokens per sequence
    micro_batch_size: int = 1   # sequences per micro-batch


# Published configurations: Llama 2 (arXiv 2307.09288, Table 1 and the released config), Llama 3 (arXiv 2407.21783, Table 3).
MODELS = {
    "Llama 2 7B": Model("Llama 2 7B", 32, 4096, 11008, 32, 32, 32000),
    "Llama 3 70B": Model("Llama 3 70B", 80, 8192, 28672, 64, 8, 128256),
    "Llama 3 405B": Model("Llama 3 405B", 126, 16384, 53248, 128, 8, 128256),
}
H100 = GPU("H100 SXM", 80e9, 989e12)  # datasheet: 80 GB HBM3, 989 TFLOP/s dense BF16
NVLINK = Link("NVLink 4", 2e-6, 450e9, "H100 SXM datasheet: 900 GB/s both ways; α a typical NCCL step")
NDR = Link("InfiniBand NDR 400 Gb/s, one NIC per GPU", 5e-6, 50e9, "datasheet line rate / 8; α a typical step")
RESERVE = 0.1  # of a GPU's memory left for the framework, buffers and fragmentation


def h100s(gpus: int) -> Cluster:
    return Cluster(gpus, 8, NVLINK, NDR)


def efficiency(width: float) -> float:
    """The fraction of peak FLOP/s a GPU reaches on matrix products whose narrow side is ``width`` (the hidden
    size over TP, or the tokens of a micro-batch over CP, whichever is less): 0.5 · w / (w + 512). A stated
    curve: 0.40 at w = 2048 (Llama 3 405B's TP 8 measured 38–43% MFU), 0.25 at 512, falling as TP cuts the
    matrices thinner or CP the sequence shorter."""
    return 0.5 * width / (width + 512)


def placement(layout: Layout, cluster: Cluster) -> dict[str, Link]:
    """Each axis's link: axes nested inner to outer TP, CP, PP, DP; a group within a node uses NVLink."""
    out, inner = {}, 1
    for axis in ("tp", "cp", "pp", "dp"):
        size = getattr(layout, axis)
        out[axis] = cluster.intra if inner * size <= cluster.per_node else cluster.inter
        inner *= size
    return out


def step_time(model: Model, layout: Layout, gpu: GPU, cluster: Cluster) -> dict[str, float]:
    """Modelled seconds of one step, by term, and their "total"."""
    L, h, s, b = model.layers, model.hidden, layout.seq, layout.micro_batch_size
    tp, pp, cp, dp, m = layout.tp, layout.pp, layout.cp, layout.dp, layout.micro_batches
    links = placement(layout, cluster)
    tokens = s * b
    flops = 6 * model.params() * tokens + 6 * L * h * s * tokens  # weights, and causal attention's scores
    recompute = 4 / 3 if layout.recompute else 1.0               # the forward again
    compute = flops * recompute / (tp * cp * pp) / (gpu.flops * efficiency(min(h / tp, tokens / cp)))
    per_layer = (6 if layout.recompute else 4) if tp > 1 else 0
    tp_comm = math.ceil(L / pp) * per_layer * links["tp"].seconds("all_reduce", tokens // cp * h * 2, tp)
    kv = tokens // cp * 2 * h * model.kv_heads // model.heads * 2  # K and V of this rank's part, BF16
    cp_comm = math.ceil(L / pp) * 3 * (cp - 1) * links["cp"].seconds("send", kv, 2) if cp > 1 else 0.0
    grads = model.stage_params(pp) / tp * 2                    # BF16 gradients of this rank's shard
    dp_comm = links["dp"].seconds("all_reduce", grads, dp * cp) if dp * cp > 1 else 0.0
    return combine(m, pp, compute, {"tp": tp_comm, "cp": cp_comm}, dp_comm, hidden=compute * 2 / 3)


def combine(m: int, pp: int, compute: float, comm: dict[str, float], dp_comm: float, hidden: float) -> dict[str, float]:
    """A step's terms under 1F1B: ``m`` micro-batches through ``pp`` stages, each costing ``compute`` seconds and
    the exposed communication ``comm`` ({axis: seconds}) a stage, so (m + pp - 1) micro-batch times; then the
    data-parallel reduction ``dp_comm``, less the ``hidden`` seconds of it that overlap the backward."""
    micro = compute + sum(comm.values())
    exposed = max(0.0, dp_comm - hidden)
    return {"compute": m * compute, **{k: m * v for k, v in comm.items()}, "bubble": (pp - 1) * micro,
            "dp": exposed, "total": (m + pp - 1) * micro + exposed}


def interleaved(terms: dict[str, float], v: int) -> dict[str, float]:
    """``terms`` of a 1F1B step with ``v`` stages a rank instead (lab 05's interleaved 1F1B): the bubble over v."""
    bubble = terms["bubble"] / v
    return {**terms, "bubble": bubble, "total": terms["total"] - terms["bubble"] + bubble}


def layouts(model: Model, cluster: Cluster, seq: int, global_tokens: int):
    """Every valid layout: powers of two; TP within a node and dividing the heads (and K/V heads); a
    whole number of sequences per data-parallel rank (micro-batches of one sequence); each with and
    without recomputation."""
    batch = global_tokens // seq
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4, 8, 16, 32):
            for pp in (1, 2, 4, 8, 16, 32):
                dp, rest = divmod(cluster.gpus, tp * cp * pp)
                if rest or dp < 1 or tp > cluster.per_node or model.heads % tp or model.kv_heads % tp:
                    continue
                if batch % dp or pp > model.layers or seq % (2 * cp):
                    continue
                for recompute in (False, True):
                    yield Layout(dp, tp, pp, cp, batch // dp, recompute, seq)


def plan(model: Model, gpu: GPU, cluster: Cluster, seq: int, global_tokens: int, memory) -> list[dict]:
    """Every valid layout with its memory per GPU (``memory(model, layout)``: {"states", "activations"}
    in bytes), its step time terms, whether it fits (its memory within the GPU's less ``RESERVE``),
    fastest first."""
    rows = []
    for layout in layouts(model, cluster, seq, global_tokens):
        mem = memory(model, layout)
        total = mem["states"] + mem["activations"]
        rows.append({"layout": layout, "memory": total, **{f"mem_{k}": v for k, v in mem.items()},
                     "fits": total <= gpu.memory * (1 - RESERVE), **step_time(model, layout, gpu, cluster)})
    return sorted(rows, key=lambda r: r["total"])


def best(rows: list[dict]) -> dict | None:
    """The fastest layout that fits."""
    return next((r for r in rows if r["fits"]), None)


def describe(layout: Layout) -> str:
    return (f"DP {layout.dp} · TP {layout.tp} · PP {layout.pp} · CP {layout.cp}, {layout.micro_batches} "
            f"micro-batches{', recomputed' if layout.recompute else ''}")
