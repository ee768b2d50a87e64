"""Lab 04 (tensor parallelism): Tasks 4.1 (column and row splits), 4.2 (Megatron's f and g, the MLP), 4.3 (attention
by heads), 4.4 (sequence parallelism), run forward and backward on the ranks (each given its own shards), judged
against a single-process reference and DTensor's result on the same ranks (not for a seed: DTensor costs seconds)."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from ..pool import PerRank
from ..strategies import tensor_parallel as tp
from ..strategies import tp_reference as ref
from . import Check, CheckFailed, answers, run_on_ranks, whose

TOL = 1e-5
_ACT = ref.B * ref.T * ref.WIDTH * 4  # bytes of a check's (3, 8, 32) fp32 activations
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_tensor", "reduce_scatter_single", "_all_gather_base", "_reduce_scatter_base",
                "broadcast", "all_to_all", "all_to_all_single")
FORBIDDEN = {
    **{f"dist.{name}": "use lablib's collectives (lablib.all_reduce, lablib.all_gather, lablib.reduce_scatter): "
                       "they are traced, so the checks and the timeline see them" for name in _COLLECTIVES},
    "dist.nn": "torch.distributed.nn's autograd-aware collectives are what this lab builds; use lablib's",
    "dist.*": "exercises move data with lablib's traced collectives only; of torch.distributed they may ask "
              "get_rank and get_world_size",
    "dist.tensor": "DTensor is what the lab compares with; build the split yourself",
    "parallelize_module": "DTensor is what the lab compares with; build the split yourself",
    "~Parallel": "DTensor's parallel styles are what the lab compares with; build the split yourself",
    "DTensor": "DTensor is what the lab compares with; build the split yourself",
    "distribute_tensor": "DTensor is what the lab compares with; build the split yourself",
    "~device_mesh": "DTensor is what the lab compares with; build the split yourself",
}


def _shape_hint(fn: str, index: str, got: str, want: str) -> str:
    """What autograd's "invalid gradient" error means: which backward returned what, and what it must."""
    g, w = ([int(k) for k in dims.split(",") if k.strip()] for dims in (got, want))
    fix = ""
    if len(g) == len(w) > 0 and g[1:] == w[1:]:  # only dim 0 differs: the backward's gather or scatter is missing
        fix = (" It is too short along dim 0: all-gather the gradient (world_size times as long)." if g[0] < w[0] else
               " It is too long along dim 0: reduce-scatter the gradient (world_size times shorter).")
    return (f"{fn}.backward returned a gradient of shape [{got}] for input {index} of its forward, whose shape is "
            f"[{want}]: a backward returns, for each input of forward, a gradient of that input's shape.{fix}")


_RANK_HINTS = (
    ("timed out", "one rank skipped a collective the others called: every rank must issue the same collectives, "
                  "in the same order."),
    ("non-contiguous", "a collective needs a contiguous tensor: pass t.contiguous()."),
    ("modified by an inplace operation", "an all-reduce wrote into a tensor autograd saved for the backward: "
                                         "all-reduce a copy (t.clone())."),
    ("does not require grad", "a Function's backward must return a gradient for each input of its forward."),
    (re.compile(r"Function (\w+)Backward returned an invalid gradient at index (\d+) - got \[([\d, ]*)\] but expected "
                r"shape compatible with \[([\d, ]*)\]"), lambda found: _shape_hint(*found.groups())),
)


def _err(got, want) -> float | None:
    """The largest difference, or None when the shapes differ (or it is not a tensor)."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return None
    return (got.detach().float() - want.float()).abs().max().item()


def _shape(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


def _close(task, where, got, want, hint, mistakes=()) -> float:
    """The largest difference from ``want``, or CheckFailed past TOL. ``mistakes``: (what ``got`` would be
    after a typical mistake, what to say) pairs: a result that matches one is named by it, not by its
    difference."""
    err = _err(got, want)
    if err is None:
        raise CheckFailed(f"{task}: {where} has {_shape(got)}, expected shape {tuple(want.shape)}. {hint}")
    if not err <= TOL:
        for wrong, why in mistakes:
            off = _err(got, wrong)
            if off is not None and off <= TOL:
                raise CheckFailed(f"{task}: {where} {why}")
        raise CheckFailed(f"{task}: {where} differs from the single-process reference by {err:.2e} (tolerance "
                          f"{TOL:g}). {hint}")
    return err


def _bias_twice(n: int, where: str, op: str) -> str:
    """What an output with fc2's bias n times means (each rank added it before the sum across ranks)."""
    return (f"holds fc2's bias {n} times: the bias was added before {where}, so every rank added it and the {op} "
            f"summed the {n} copies. Add it once, after {where}.")


def _per_rank(task, data, world_size):
    if not isinstance(data, list) or len(data) != world_size or not all(isinstance(r, dict) for r in data):
        raise CheckFailed(f"{task}: expected one result per rank from {world_size} ranks.")


def _ops(task, where, got, want, hint) -> None:
    """``got``: the collectives issued ("all_reduce 3072": name, bytes in); ``want``: [(name, bytes)]."""
    names = [str(g).split(" ")[0] for g in got]
    if names != [op for op, _ in want]:
        name = lambda ops: ", ".join(op.replace("_", "-") for op in ops) or "no collective"  # noqa: E731
        raise CheckFailed(f"{task}: {where} issued {name(names)}; expected exactly {name(op for op, _ in want)}. {hint}")
    for g, (op, nbytes) in zip(got, want):
        if g != f"{op} {nbytes}":
            raise CheckFailed(f"{task}: {where}'s {op.replace('_', '-')} took {g.split(' ')[-1]} bytes in; expected "
                              f"{nbytes}, the activations' share of this rank ({nbytes // 4} floats). Tensor "
                              "parallelism communicates activations and their gradients, never weights.")


def _reference(layer, x, dy, params):
    """``layer(x)``, and the gradients of (output * dy).sum() for x and ``params``, in one process."""
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    (y * dy).sum().backward()
    return y.detach(), x.grad, [p.grad for p in params]


def _dtensor(task, rank, got, grads) -> float:
    """The learner's output and gradients (the input's first) against DTensor's on the same rank."""
    d = got.get("dtensor")
    if not d:
        return 0.0
    pairs = [(got["out"], d["out"]), (grads[0], d["x"]), *zip(grads[1:], d["grads"])]
    worst = max(_err(a, b) if _err(a, b) is not None else float("inf") for a, b in pairs)
    if not worst <= TOL:
        raise CheckFailed(f"{task}: rank {rank}'s output or gradients differ from DTensor's by {worst:.2e}, though "
                          "they match the single-process reference: tell the course's maintainers.")
    return worst


# -- Task 4.1: column- and row-parallel linear layers -------------------------------------------------------
def collect_split(fns, pool, seed):
    return run_on_ranks(pool, "Task 4.1", ref.split_job, *fns, seed, hints=_RANK_HINTS)


def judge_split(data, world_size, seed) -> str:
    task, n = "Task 4.1", world_size
    _per_rank(task, data, n)
    ff, _ = ref.layers(seed or 0)
    x, dy, _ = ref.inputs(seed or 0, ref.B, ref.T, ref.WIDTH)
    w1, b1, w2, b2 = (t.detach() for t in (ff.fc1.weight, ff.fc1.bias, ff.fc2.weight, ff.fc2.bias))
    h = F.gelu(ff.fc1(x)).detach()
    with torch.no_grad():
        full2 = ff.fc2(h)
    for r, got in enumerate(data):
        want_w1, want_b1 = answers("lab04").shard_column(w1, b1, r, n)
        if _err(got["w1"], w1.chunk(n, 1)[r]) == 0.0:
            raise CheckFailed(f"{task}: shard_column split fc1.weight along dim 1. A Linear's weight is (out_features, "
                              "in_features): the columns of A in Y = X A are the weight's rows, so a column-parallel "
                              "split takes rows, weight.chunk(world_size, 0)[rank].")
        _close(task, f"rank {r}'s shard_column weight", got["w1"], want_w1,
               "Rank r keeps the r-th of world_size equal blocks of output features (rows of the weight).")
        _close(task, f"rank {r}'s shard_column bias", got["b1"], want_b1,
               "The bias belongs to the output features: each rank keeps the slice for its features.")
        if _err(got["w2"], w2.chunk(n, 0)[r]) == 0.0:
            raise CheckFailed(f"{task}: shard_row split fc2.weight along dim 0 (its output features). A row-parallel "
                              "split takes the input features, the weight's columns: weight.chunk(world_size, 1)[rank].")
        _close(task, f"rank {r}'s shard_row weight", got["w2"], w2.chunk(n, 1)[r],
               "Rank r keeps the r-th block of input features (columns of the weight).")
        _close(task, f"rank {r}'s shard_row bias", got["b2"], b2,
               "A row-parallel layer's outputs are whole on every rank: keep the whole bias (it is added once, "
               "after the all-reduce).")
        _close(task, f"rank {r}'s column-parallel output", got["column"], F.linear(x, want_w1, want_b1), "")
        lw1, lb1 = tp.leaves(w1, b1)
        (F.linear(x, lw1, lb1) * dy).sum().backward()
        for what, g, want in zip(("weight", "bias"), got["column_grads"], answers("lab04").shard_column(lw1.grad, lb1.grad, r, n)):
            _close(task, f"rank {r}'s gradient of its fc1 {what} shard", g, want,
                   "A column-parallel shard's gradient is the same slice of the whole layer's gradient.")
        _ops(task, f"rank {r}'s row_linear", got["row_ops"], [("all_reduce", _ACT)],
             "A row-parallel layer sums the ranks' partial products with one all-reduce (lablib.all_reduce).")
        _close(task, f"rank {r}'s row_linear output", got["row"], full2,
               "Multiply this rank's slice of the input by its weight shard (no bias), all-reduce the partial "
               "products in place, then add the bias.",
               [(full2 + (n - 1) * b2, _bias_twice(n, "the all-reduce", "all-reduce"))])
    return (f" on {world_size} ranks: fc1 split by output features (forward and its weights' gradients) and fc2 "
            "by input features (forward, one all-reduce) match the single-process layers")


check_split = Check("Task 4.1", ("shard_column", "shard_row", "row_linear"), collect_split, judge_split,
                    world_sizes=(2, 4), forbidden=FORBIDDEN, every_size=True)
"""Task 4.1: a Linear's weight split by output features (column-parallel) and by input features (row-parallel)."""


# -- Task 4.2: f and g, the tensor-parallel MLP -----------------------------------------------------------
def given_shards(world_size, seed) -> list[dict]:  # per rank, the layers' shards, by lablib's answers
    return answers("lab04").shards(*ref.layers(seed or 0), world_size)


def collect_mlp(fns, pool, seed, shards):
    return run_on_ranks(pool, "Task 4.2", ref.mlp_job, *fns, PerRank(shards), seed, seed is None, hints=_RANK_HINTS)


_NAMES = ("the input's gradient", "fc1's weight-shard gradient", "fc1's bias-shard gradient",
          "fc2's weight-shard gradient", "fc2's bias gradient")


_SWAPPED = ("is what f and g swapped give: Copy (f) all-reduced the input in its forward, so each rank computed on "
            "world_size times x, and Reduce (g) passed fc2's partial products through. f is the identity forward "
            "(it all-reduces in its backward); g all-reduces in its forward (and is the identity backward).")


def _swapped(model, x, r, n):
    """Rank r's MLP output with f and g swapped: fc1 of the summed (n times) input, fc2's partial product."""
    w1, b1 = answers("lab04").shard_column(model.fc1.weight.detach(), model.fc1.bias.detach(), r, n)
    w2, b2 = answers("lab04").shard_row(model.fc2.weight.detach(), model.fc2.bias.detach(), r, n)
    return F.linear(F.gelu(F.linear(n * x, w1, b1)), w2) + b2


def judge_mlp(data, world_size, seed) -> str:
    task, n = "Task 4.2", world_size
    _per_rank(task, data, n)
    ff, _ = ref.layers(seed or 0)
    x, _, dy = ref.inputs(seed or 0, ref.B, ref.T, ref.WIDTH)
    model = ref.MLP(ff)
    y, gx, (g1, gb1, g2, gb2) = _reference(model, x, dy, [model.fc1.weight, model.fc1.bias, model.fc2.weight,
                                                          model.fc2.bias])
    worst = dtensor = 0.0
    for r, got in enumerate(data):
        if got.get("out") is None:
            raise CheckFailed(f"{task}: rank {r}'s tp_mlp returned {_shape(got.get('out'))}, expected the MLP's "
                              f"output, shape {tuple(y.shape)}, whole on every rank.")
        if _err(got["out"], y) is not None and _err(got["out"], y) > TOL and not any(str(g).startswith("all_reduce") for g in got["fwd"]):
            raise CheckFailed(f"{task}: rank {r}'s output is its partial sum: g (Reduce) must all-reduce fc2's "
                              "partial products in its forward.")
        _ops(task, f"rank {r}'s forward", got["fwd"], [("all_reduce", _ACT)],
             "The forward all-reduces once, in g (Reduce.forward); f (Copy.forward) is the identity.")
        worst = max(worst, _close(task, f"rank {r}'s output", got["out"], y,
                                  "fc1 column-parallel (f first), GELU, fc2 row-parallel without bias, g, then the "
                                  "bias.", [(y + (n - 1) * model.fc2.bias.detach(),
                                             _bias_twice(n, "g (Reduce)", "all-reduce")),
                                            (_swapped(model, x, r, n), _SWAPPED)]))
        _ops(task, f"rank {r}'s backward", got["bwd"], [("all_reduce", _ACT)],
             "The backward all-reduces once, in f (Copy.backward), the input's gradient; g's backward "
             "(Reduce.backward) passes the gradient through.")
        wants = [gx, *answers("lab04").shard_column(g1, gb1, r, n), *answers("lab04").shard_row(g2, gb2, r, n)]
        for name, g, want in zip(_NAMES, got["grads"], wants):
            hint = ("Each rank's input gradient is a partial sum over its features: f's backward (Copy.backward) "
                    "must all-reduce it." if name == _NAMES[0] else "")
            worst = max(worst, _close(task, f"rank {r}'s {name}", g, want, hint))
        dtensor = max(dtensor, _dtensor(task, r, got, got["grads"]))
    return (f" on {world_size} ranks: output and gradients match the single-process MLP (max error {worst:.1e}) and "
            f"DTensor's ColwiseParallel/RowwiseParallel (max difference {dtensor:.1e}), with one all-reduce forward "
            "and one backward")


check_mlp = Check("Task 4.2", ("tp_mlp",), collect_mlp, judge_mlp, world_sizes=(2, 4), forbidden=FORBIDDEN,
                  every_size=True, given=given_shards)
"""Task 4.2: Megatron's f and g as autograd Functions, and the MLP column- then row-parallel."""


# -- Task 4.3: attention, split by heads -------------------------------------------------------------------
def collect_attention(fns, pool, seed, shards):
    return run_on_ranks(pool, "Task 4.3", ref.attention_job, *fns, PerRank(shards), seed, seed is None,
                        hints=_RANK_HINTS)


def _core(att, causal: bool = True):
    """Attention without LayerNorm and residual: what tp_attention computes (``causal=False``: the mistake of
    leaving out the mask)."""
    def run(x):
        B, T, d = x.shape
        q, k, v = att.qkv(x).view(B, T, 3, att.heads, d // att.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return att.proj(y.transpose(1, 2).reshape(B, T, d))
    return run


def _untransposed(att, x, n):
    """The output when each rank reshapes its heads' (B, heads, T, head_dim) attention to (B, T, -1) without
    the transpose, summed over the ranks by g."""
    B, T, d = x.shape
    q, k, v = att.qkv(x).view(B, T, 3, att.heads, d // att.heads).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = att.heads // n
    parts = [F.linear(y[:, r * h:(r + 1) * h].reshape(B, T, -1), att.proj.weight.chunk(n, 1)[r]) for r in range(n)]
    return sum(parts) + att.proj.bias


def judge_attention(data, world_size, seed) -> str:
    task, n = "Task 4.3", world_size
    _per_rank(task, data, n)
    _, att = ref.layers(seed or 0)
    x, _, dy = ref.inputs(seed or 0, ref.B, ref.T, ref.WIDTH)
    w, b = att.qkv.weight.detach(), att.qkv.bias.detach()
    y, gx, (gq, gbq, go, gbo) = _reference(_core(att), x, dy, [att.qkv.weight, att.qkv.bias, att.proj.weight,
                                                              att.proj.bias])
    with torch.no_grad():
        unmasked = _core(att, causal=False)(x)
        bias_n = y + (n - 1) * att.proj.bias.detach()
        untransposed = _untransposed(att, x, n)
    worst = dtensor = 0.0
    for r, got in enumerate(data):
        want_w, want_b = answers("lab04").shard_qkv(w, b, r, n)
        if _err(got["wqkv"], w.chunk(n, 0)[r]) == 0.0:
            raise CheckFailed(f"{task}: rank {r}'s shard_qkv took a contiguous block of the fused weight's rows. Its "
                              "rows are [Q; K; V], each for all heads, so that block is not this rank's heads (rank "
                              "0 would get most of Q and none of V): take this rank's heads' rows from each of Q, K "
                              "and V, and put them back in the order Q, K, V.")
        _close(task, f"rank {r}'s shard_qkv weight", got["wqkv"], want_w,
               f"With {ref.HEADS} heads of {ref.WIDTH // ref.HEADS} features on {n} ranks, rank r keeps heads "
               f"r*{ref.HEADS // n} to (r+1)*{ref.HEADS // n}-1 of Q, of K and of V: weight.view(3, world_size, -1, "
               "d_in) picks them.")
        _close(task, f"rank {r}'s shard_qkv bias", got["bqkv"], want_b, "Split the bias as the weight's rows.")
        if got.get("out") is None:
            raise CheckFailed(f"{task}: rank {r}'s tp_attention returned {_shape(got.get('out'))}, expected shape "
                              f"{tuple(y.shape)}, whole on every rank.")
        _ops(task, f"rank {r}'s forward", got["fwd"], [("all_reduce", _ACT)], "Use your f (Copy) before the QKV projection "
             "and your g (Reduce) after the output projection, as in the MLP.")
        worst = max(worst, _close(task, f"rank {r}'s output", got["out"], y,
                                  "Each rank attends with its own heads only (heads = the heads on this rank): "
                                  "q, k, v from F.linear(f(x), wqkv, bqkv).view(B, T, 3, heads, head_dim).",
                                  [(unmasked, "is attention without the causal mask: each token attended to the "
                                              "tokens after it too. Pass is_causal=True to "
                                              "F.scaled_dot_product_attention: a token sees itself and the tokens "
                                              "before it."),
                                   (bias_n, _bias_twice(n, "g (Reduce)", "all-reduce").replace("fc2's", "the projection's")),
                                   (untransposed, "mixes tokens and heads: the attention's output is (B, heads, T, "
                                                  "head_dim), and reshaping it to (B, T, heads * head_dim) without "
                                                  "moving the heads next to head_dim first puts another token's "
                                                  "numbers in each row. Transpose it, y.transpose(1, 2), then "
                                                  "reshape.")]))
        _ops(task, f"rank {r}'s backward", got["bwd"], [("all_reduce", _ACT)], "f's backward all-reduces the input's gradient.")
        wants = [gx, *answers("lab04").shard_qkv(gq, gbq, r, n), *answers("lab04").shard_row(go, gbo, r, n)]
        names = ("the input's gradient", "the QKV weight-shard gradient", "the QKV bias-shard gradient",
                 "the output projection's weight-shard gradient", "the output projection's bias gradient")
        for name, g, want in zip(names, got["grads"], wants):
            worst = max(worst, _close(task, f"rank {r}'s {name}", g, want, ""))
        # DTensor's Q, K and V are three layers: against them, the thirds of the fused shard's gradient
        dtensor = max(dtensor, _dtensor(task, r, got, [got["grads"][0], *got["grads"][1].chunk(3), got["grads"][3]]))
    return (f" on {world_size} ranks: {ref.HEADS // n} head{'s' if ref.HEADS // n > 1 else ''} per rank; output and gradients match single-process "
            f"attention (max error {worst:.1e}) and DTensor with Q, K, V ColwiseParallel and the projection "
            f"RowwiseParallel (max difference {dtensor:.1e})")


check_attention = Check("Task 4.3", ("shard_qkv", "tp_attention"), collect_attention, judge_attention,
                        world_sizes=(2, 4), forbidden=FORBIDDEN, every_size=True, given=given_shards)
"""Task 4.3: self-attention with its heads split across ranks."""


# -- Task 4.4: sequence parallelism -------------------------------------------------------------------------
def collect_sp(fns, pool, seed, shards):
    return run_on_ranks(pool, "Task 4.4", ref.sp_job, *fns, PerRank(shards), seed, seed is None, hints=_RANK_HINTS)


def judge_sp(data, world_size, seed) -> str:
    task, n = "Task 4.4", world_size
    _per_rank(task, data, n)
    ff, _ = ref.layers(seed or 0)
    x, _, dy = ref.inputs(seed or 0, ref.T, ref.B, ref.WIDTH)
    params = [ff.ln.weight, ff.ln.bias, ff.fc1.weight, ff.fc1.bias, ff.fc2.weight, ff.fc2.bias]
    y, gx, (glw, glb, g1, gb1, g2, gb2) = _reference(ff, x, dy, params)
    worst = dtensor = 0.0
    for r, got in enumerate(data):
        if got.get("out") is None:
            raise CheckFailed(f"{task}: rank {r}'s sp_feed_forward returned {_shape(got.get('out'))}, expected this "
                              f"rank's part of the sequence, shape {tuple(y.chunk(n)[r].shape)}.")
        _ops(task, f"rank {r}'s forward", got["fwd"], [("all_gather", _ACT // n), ("reduce_scatter", _ACT)],
             "Gather the normalised sequence before fc1 (your Gather.forward: all-gather) and reduce-scatter fc2's "
             "partial products (your Scatter.forward); no all-reduce.")
        mine = y.chunk(n)[r]
        worst = max(worst, _close(task, f"rank {r}'s output", got["out"], mine,
                                  "LayerNorm on this rank's tokens, Gather, fc1, GELU, fc2 (no bias), Scatter, then "
                                  "the bias and the residual (this rank's x).",
                                  [(mine + (n - 1) * ff.fc2.bias.detach(), _bias_twice(n, "Scatter", "reduce-scatter")),
                                   (mine - x.chunk(n)[r], "lacks the residual: it is fc2's output and bias alone. Add "
                                                          "this rank's x (x + Scatter(...) + bias): the sub-block is "
                                                          "x + fc2(GELU(fc1(LayerNorm(x)))).")]))
        _ops(task, f"rank {r}'s backward", got["bwd"], [("all_gather", _ACT // n), ("reduce_scatter", _ACT)],
             "Scatter's backward all-gathers the gradient; Gather's backward reduce-scatters it.")
        wants = [gx.chunk(n)[r], glw, glb, *answers("lab04").shard_column(g1, gb1, r, n), *answers("lab04").shard_row(g2, gb2, r, n)]
        names = ("the gradient of its part of the input", "LayerNorm's weight gradient (summed over ranks)",
                 "LayerNorm's bias gradient (summed over ranks)", "fc1's weight-shard gradient",
                 "fc1's bias-shard gradient", "fc2's weight-shard gradient", "fc2's bias gradient (summed over ranks)")
        for name, g, want in zip(names, got["grads"], wants):
            hint = ("Gather's backward must reduce-scatter the gradient: each rank's fc1 saw the whole sequence, "
                    "so the input gradients are partial sums." if name == names[0] else "")
            worst = max(worst, _close(task, f"rank {r}'s {name}", g, want, hint))
        dtensor = max(dtensor, _dtensor(task, r, got, [got["grads"][0], got["grads"][1], got["grads"][3]]))
    return (f" on {world_size} ranks: each rank holds {ref.T // n} of the {ref.T} tokens outside the tensor-parallel "
            f"region; output and gradients match the single-process sub-block (max error {worst:.1e}) and DTensor's "
            f"SequenceParallel (max difference {dtensor:.1e})")


check_sp = Check("Task 4.4", ("sp_feed_forward",), collect_sp, judge_sp, world_sizes=(2, 4), forbidden=FORBIDDEN,
                 every_size=True, given=given_shards)
"""Task 4.4: the feed-forward sub-block with sequence parallelism."""


# -- the notebook's measurements run the learner's functions once they have passed -----------------------
_TASKS = {"tp_mlp": ("Task 4.2", "mlp"), "tp_attention": ("Task 4.3", "attention"),
          "sp_feed_forward": ("Task 4.4", "sp")}


def yours(**fns) -> tp.Fns:
    """A measurement's functions: the learner's whose check passed in this kernel, else lablib's (printed)."""
    mine = whose(fns, {k: task for k, (task, _) in _TASKS.items()})
    lablibs = answers("lab04").FNS  # the weights split as lablib splits them: the checks gave the learner's the same
    return tp.Fns(**{name: getattr(lablibs, name) for name in ("shard_column", "shard_row", "shard_qkv")},
                  **{name: fns[k] if k in mine else getattr(lablibs, name) for k, (_, name) in _TASKS.items()})
