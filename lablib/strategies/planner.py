"""Which layout for a model on a cluster: every valid (DP, TP, PP with v stages a rank, CP, micro-batches,
recomputation), its memory per GPU and its step time (modelled here, every term stated), and the fastest that fits.

Two quantities, not one. A matmul's **efficiency** is the fraction of the GPU's peak FLOP/s one matrix product
reaches (``matmul_efficiency``: a stated curve under 0.80, the best BF16 matmul measured on an H100). **MFU**
(model FLOPs utilisation, PaLM's measure, which Llama 3 reports) is what a whole step achieves: the model's
FLOPs (``model_flops``: PaLM's 6·N + 12·L·h·s a token) over step time × GPUs × peak. The bubble, the exposed
communication and whatever the model leaves out lie between the two.

Step time, per the labs: the micro-batches' compute (the weights' matmuls at their efficiency; causal attention,
half of PaLM's 12·L·h·s as FlashAttention executes it, at FlashAttention-2's ``ATTENTION``); tensor
parallelism's all-reduces (lab 04: 4 a layer per micro-batch, 6 with recomputation), exposed; context
parallelism's K/V exchange (lab 06), as Llama 3 ran it (``"all_gather"``: this rank's K/V heads gathered before
attention, their gradients reduce-scattered after, exposed; the planner's default) or as a ring whose sends hide
under the layer's attention (``"ring"``); the pipeline's bubble: under 1F1B each stage idles p − 1 of the
m + p − 1 micro-batch slots of a step (lab 05), a fraction (p − 1)/(m + p − 1), and with v stages a rank
(interleaved 1F1B) (p − 1)/v slots; the data-parallel gradient reduction past the last micro-batch's backward,
which it overlaps. Collectives under lab 02's α-β model on datasheet links, each axis placed inner to outer
TP, CP, PP, DP (Llama 3's order): an axis whose group fits in a node uses NVLink, any other the network. Not
modelled: the embedding's lookups, the pipeline's sends (Llama 3 made them asynchronous), stage imbalance,
kernels other than matmuls and attention (norms, RoPE, SwiGLU's products, the loss), launch overheads,
stragglers.

Memory: ``plan`` takes it as a function (the learner's, Task 8.4: ZeRO-1 over dp × cp with BF16 gradients;
or ``with_fsdp`` of it, Llama 3's FSDP with FP32 gradients, ``fsdp_states``); with v > 1 stages a rank the
first stage holds 1 + (p − 1)/(p·v) times 1F1B's activations (Narayanan et al. 2021; Korthikanti et al. 2022).
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

    def activation_terms(self) -> dict[str, float]:
        """What one layer keeps for its backward, in units of s·b·h bytes (BF16, no dropout, FlashAttention
        keeping Q, K, V and its output, not the scores): Korthikanti et al.'s count for a GPT layer (34 with its
        dropout masks and GELU MLP of 4h) redone for this layer's GQA and SwiGLU."""
        kv, f = 2 * self.kv_heads / self.heads, 2 * self.ffn / self.hidden
        return {"attention norm's input and output": 4, "Q": 2, "K and V": 2 * kv, "attention's output": 2,
                "MLP norm's input and output": 4, "gate, up, SiLU(gate) and their product": 4 * f}


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
    v: int = 1          # pipeline stages a rank holds: 1 is 1F1B, more is interleaved 1F1B
    cp_style: str = "all_gather"  # how context parallelism exchanges K and V: "all_gather" (Llama 3's) or "ring"


# Published configurations: Llama 2 (arXiv 2307.09288, Table 1 and the released config), Llama 3 (arXiv 2407.21783, Table 3).
MODELS = {
    "Llama 2 7B": Model("Llama 2 7B", 32, 4096, 11008, 32, 32, 32000),
    "Llama 3 70B": Model("Llama 3 70B", 80, 8192, 28672, 64, 8, 128256),
    "Llama 3 405B": Model("Llama 3 405B", 126, 16384, 53248, 128, 8, 128256),
}
# Datasheet: 989 TFLOP/s dense BF16; "80 GB" of HBM3 is 81,559 MiB (85.5e9 bytes) as CUDA reports it.
H100 = GPU("H100 SXM", 81_559 * 2**20, 989e12)
NVLINK = Link("NVLink 4", 2e-6, 450e9, "H100 SXM datasheet: 900 GB/s both ways; α a typical NCCL step")
NETWORK = Link("400 Gb/s a GPU between nodes", 5e-6, 50e9, "datasheet line rate / 8, the same for RoCE (Llama 3 405B's "
               "network) and InfiniBand NDR; α a typical step")
RESERVE = 0.1  # of a GPU's memory left for the framework, buffers and fragmentation
# The best BF16 matmul measured on an H100 SXM: 794 of 989 TFLOP/s (the MAMF table of S. Bekman's Machine Learning
# Engineering, github.com/stas00/ml-engineering, compute/accelerator).
MATMUL_BEST = 0.80
# FlashAttention-2 on an H100: 35% of peak (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, its abstract).
ATTENTION = 0.35
# Llama 3 405B's layouts and BF16 MFU (arXiv 2407.21783, Table 4; a global batch of 16M tokens). The paper does not
# print v; its words imply 8: with one layer fewer on the first stage, "the first model chunk on the first stage
# has only the embedding", so a chunk is one layer, and 126 layers + the embedding's and the output's chunks = 16 × 8.
LLAMA3 = {"8,192 GPUs, 8k": (8192, Layout(64, 8, 16, 1, 32, False, 8192, v=8), 0.43),
          "16,384 GPUs, 8k": (16384, Layout(128, 8, 16, 1, 16, False, 8192, v=8), 0.41),
          "16,384 GPUs, 128k": (16384, Layout(8, 8, 16, 16, 16, False, 131072, v=8), 0.38)}
LLAMA3_TOKENS = 2048 * 8192


def h100s(gpus: int) -> Cluster:
    return Cluster(gpus, 8, NVLINK, NETWORK)


def matmul_efficiency(width: float) -> float:
    """The fraction of peak FLOP/s a matrix product reaches when its narrow side is ``width`` (the hidden size
    over TP, or a micro-batch's tokens over CP, whichever is less): ``MATMUL_BEST`` · w / (w + 128). A stated
    curve, not measured: 0.75 at w = 2048, 0.64 at 512, falling as TP cuts the matrices thinner."""
    return MATMUL_BEST * width / (width + 128)


def model_flops(model: Model, seq: int, tokens: int) -> float:
    """The FLOPs MFU counts for ``tokens`` tokens in sequences of ``seq``: PaLM's (Chowdhery et al. 2023,
    Appendix B), 6·N + 12·L·h·s a token, N every parameter (405B: the input embedding's 2.1B does no matmul,
    0.5%, left in), attention counted whole (a causal kernel executes half of it); no recomputation."""
    return (6 * model.params() + 12 * model.layers * model.hidden * seq) * tokens


def mfu(model: Model, layout: Layout, gpu: GPU, gpus: int, seconds: float, tokens: int) -> float:
    """Model FLOPs utilisation of a step of ``seconds`` on ``gpus``: model_flops / (seconds × gpus × peak)."""
    return model_flops(model, layout.seq, tokens) / (seconds * gpus * gpu.flops)


def placement(layout: Layout, cluster: Cluster) -> dict[str, Link]:
    """Each axis's link: axes nested inner to outer TP, CP, PP, DP; a group within a node uses NVLink."""
    out, inner = {}, 1
    for axis in ("tp", "cp", "pp", "dp"):
        size = getattr(layout, axis)
        out[axis] = cluster.intra if inner * size <= cluster.per_node else cluster.inter
        inner *= size
    return out


def cp_seconds(layout: Layout, link: Link, kv: int, attention: float) -> float:
    """One layer's exposed K/V exchange for a micro-batch (``kv``: this rank's K and V bytes; ``attention``: the
    layer's attention seconds, forward and backward). "all_gather" (Llama 3's): the forward all-gathers K and V
    (again when recomputed), the backward reduce-scatters their gradients, each before the attention it feeds.
    "ring" (lab 06's): 3 (cp − 1) sends (K/V forward; K/V and dK/dV backward) under the attention they overlap."""
    cp = layout.cp
    if layout.cp_style == "ring":
        return max(0.0, 3 * (cp - 1) * link.seconds("send", kv, 2) - attention)
    return (3 if layout.recompute else 2) * link.seconds("all_gather", kv, cp)


def step_time(model: Model, layout: Layout, gpu: GPU, cluster: Cluster) -> dict[str, float]:
    """Modelled seconds of one step, by term, and their "total"."""
    L, h, s, b = model.layers, model.hidden, layout.seq, layout.micro_batch_size
    tp, pp, cp, dp, m = layout.tp, layout.pp, layout.cp, layout.dp, layout.micro_batches
    links, tokens, shards = placement(layout, cluster), s * b, tp * cp * pp
    again = 4 / 3 if layout.recompute else 1.0  # the forward again
    weights = 6 * model.params() * tokens / shards / (gpu.flops * matmul_efficiency(min(h / tp, tokens / cp)))
    attention = 6 * L * h * s * tokens / shards / (gpu.flops * ATTENTION)  # causal: half of PaLM's 12·L·h·s
    compute = (weights + attention) * again
    per_layer = (6 if layout.recompute else 4) if tp > 1 else 0
    tp_comm = math.ceil(L / pp) * per_layer * links["tp"].seconds("all_reduce", tokens // cp * h * 2, tp)
    kv = tokens // cp * 2 * (h * model.kv_heads // model.heads // tp) * 2  # this rank's K/V heads, BF16
    cp_comm = math.ceil(L / pp) * cp_seconds(layout, links["cp"], kv, attention * again * pp / L) if cp > 1 else 0.0
    grads = model.stage_params(pp) / tp * 2                    # BF16 gradients of this rank's shard
    dp_comm = links["dp"].seconds("all_reduce", grads, dp * cp) if dp * cp > 1 else 0.0
    return combine(m, pp, compute, {"tp": tp_comm, "cp": cp_comm}, dp_comm, hidden=compute * 2 / 3, v=layout.v)


def combine(m: int, pp: int, compute: float, comm: dict[str, float], dp_comm: float, hidden: float,
            v: int = 1) -> dict[str, float]:
    """A step's terms: ``m`` micro-batches through ``pp`` stages, each costing ``compute`` seconds and the exposed
    communication ``comm`` ({axis: seconds}) a stage, so m busy micro-batch slots; the bubble, the p − 1 slots
    each stage idles under 1F1B, (p − 1)/v of them with ``v`` stages a rank; then the data-parallel reduction
    ``dp_comm``, less the ``hidden`` seconds of it that overlap the last backward."""
    micro = compute + sum(comm.values())
    bubble = (pp - 1) / v * micro
    exposed = max(0.0, dp_comm - hidden)
    return {"compute": m * compute, **{k: m * t for k, t in comm.items()}, "bubble": bubble, "dp": exposed,
            "total": m * micro + bubble + exposed}


def interleave_factor(layout: Layout) -> float:
    """How many times 1F1B's activations interleaved 1F1B's first stage holds: 1 + (p − 1)/(p·v) for v ≥ 2 (its
    warm-up runs v·p + p − 1 stage-forwards of L/(p·v) layers; Narayanan et al. 2021, Korthikanti et al. 2022)."""
    p, v = layout.pp, layout.v
    return 1.0 if v == 1 or p == 1 else 1 + (p - 1) / (p * v)


def fsdp_states(model: Model, layout: Layout) -> float:
    """Bytes of weights, gradients and Adam's state one GPU holds under Llama 3's sharding (arXiv 2407.21783,
    §3.3.2 and §3.3.4): FSDP over the ranks that hold the same weights (dp × cp), "shards the optimizer states
    and gradients" but keeps the BF16 weights whole through the step (not resharded after the forward): 2 bytes
    a parameter; gradients accumulated and reduce-scattered in FP32: 4, sharded; the FP32 master copy and Adam's
    two moments, 4 + 4 + 4 = 12, sharded. (A micro-batch's gradients before their reduce-scatter: not counted.)"""
    psi = model.stage_params(layout.pp) / layout.tp
    return 2 * psi + (4 + 12) * psi / (layout.dp * layout.cp)


def with_fsdp(memory):
    """``memory`` (a function of (model, layout) -> {"states", "activations"}) with Llama 3's states, ``fsdp_states``."""
    return lambda model, layout: {**memory(model, layout), "states": fsdp_states(model, layout)}


def layouts(model: Model, cluster: Cluster, seq: int, global_tokens: int):
    """Every valid layout: powers of two; TP within a node and dividing the heads (and K/V heads); a whole number
    of sequences per data-parallel rank (micro-batches of one sequence); v = 1, 2, 4 or 8 stages a rank, each
    stage of a layer at least; CP exchanging K/V as Llama 3 did (all-gather); each with and without recomputation."""
    batch = global_tokens // seq
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4, 8, 16, 32):
            for pp in (1, 2, 4, 8, 16, 32):
                dp, rest = divmod(cluster.gpus, tp * cp * pp)
                if rest or dp < 1 or tp > cluster.per_node or model.heads % tp or model.kv_heads % tp:
                    continue
                if batch % dp or pp > model.layers or seq % (2 * cp):
                    continue
                for v in (1, 2, 4, 8) if pp > 1 else (1,):
                    if pp * v > model.layers:
                        continue
                    for recompute in (False, True):
                        yield Layout(dp, tp, pp, cp, batch // dp, recompute, seq, v=v)


def plan(model: Model, gpu: GPU, cluster: Cluster, seq: int, global_tokens: int, memory) -> list[dict]:
    """Every valid layout with its memory per GPU (``memory(model, layout)``: {"states", "activations"} in bytes
    under 1F1B, the activations then times ``interleave_factor``), its step time terms and MFU, whether it fits
    (its memory within the GPU's less ``RESERVE``), fastest first."""
    rows = []
    for layout in layouts(model, cluster, seq, global_tokens):
        rows.append(row(model, layout, gpu, cluster, memory, global_tokens))
    return sorted(rows, key=lambda r: r["total"])


def row(model: Model, layout: Layout, gpu: GPU, cluster: Cluster, memory, global_tokens: int) -> dict:
    """One layout's row of ``plan``."""
    mem = dict(memory(model, layout))
    mem["activations"] *= interleave_factor(layout)
    total = mem["states"] + mem["activations"]
    terms = step_time(model, layout, gpu, cluster)
    return {"layout": layout, "memory": total, **{f"mem_{k}": v for k, v in mem.items()},
            "fits": total <= gpu.memory * (1 - RESERVE), **terms,
            "mfu": mfu(model, layout, gpu, cluster.gpus, terms["total"], global_tokens)}


def best(rows: list[dict]) -> dict | None:
    """The fastest layout that fits."""
    return next((r for r in rows if r["fits"]), None)


def against_published(memory, v: int | None = None, model: Model = MODELS["Llama 3 405B"], gpu: GPU = H100) -> dict:
    """Llama 3's layouts (``LLAMA3``; with ``v`` stages a rank instead of 8, if given) as the planner models them,
    beside what the paper published: {title: the layout's row of ``plan``, with "published" (its MFU),
    "their_step" (the step that MFU implies under the same FLOP count: model_flops / (MFU × GPUs × peak)) and
    "missing" (their_step less the modelled step: the seconds in none of the model's terms)}."""
    out = {}
    for title, (gpus, layout, published) in LLAMA3.items():
        layout = layout if v is None else layout._replace(v=v)
        r = row(model, layout, gpu, h100s(gpus), memory, LLAMA3_TOKENS)
        theirs = model_flops(model, layout.seq, LLAMA3_TOKENS) / (published * gpus * gpu.flops)
        out[title] = {**r, "published": published, "their_step": theirs, "missing": theirs - r["total"]}
    return out


def describe(layout: Layout) -> str:
    pp = f"PP {layout.pp}" + (f" (v {layout.v})" if layout.v > 1 else "")
    cp = f"CP {layout.cp}" + (" ring" if layout.cp > 1 and layout.cp_style == "ring" else "")
    return (f"DP {layout.dp} · TP {layout.tp} · {pp} · {cp}, {layout.micro_batches} "
            f"micro-batches{', recomputed' if layout.recompute else ''}")
