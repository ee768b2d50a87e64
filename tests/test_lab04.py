"""Lab 04 (tensor parallelism): lablib's column/row splits, f and g, attention by heads and sequence
parallelism against the single-process reference and DTensor; the measured block's timeline and bytes;
Tasks 4.1-4.4's checks on right answers and typical mistakes."""
import ast

import pytest
import torch
import torch.nn.functional as F

import lablib
from lablib import comm
from lablib.checks import PASSED, TRIED, CheckFailed
from lablib.pool import PerRank
from lablib.checks.lab04 import (check_attention, given_shards, check_mlp, check_sp, check_split, judge_attention, judge_mlp,
                                 judge_sp, judge_split, yours)
from lablib.answers import lab04 as answers
from lablib.strategies import tensor_parallel as tp
from lablib.strategies import tp_reference as ref


# -- a learner's answers (defined here: checks refuse lablib's own functions) ------------------------------
def shard_column(weight, bias, rank, world_size):
    return weight.chunk(world_size, 0)[rank], bias.chunk(world_size, 0)[rank]


def shard_row(weight, bias, rank, world_size):
    return weight.chunk(world_size, 1)[rank], bias


def row_linear(x, weight, bias):
    y = F.linear(x, weight)
    lablib.all_reduce(y)
    return y + bias


class Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        lablib.all_reduce(grad)
        return grad


class Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        lablib.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_mlp(x, w1, b1, w2, b2):
    h = F.gelu(F.linear(Copy.apply(x), w1, b1))
    return Reduce.apply(F.linear(h, w2)) + b2


def shard_qkv(weight, bias, rank, world_size):
    w = torch.cat([part.chunk(world_size, 0)[rank] for part in weight.chunk(3, 0)])
    b = torch.cat([part.chunk(world_size, 0)[rank] for part in bias.chunk(3, 0)])
    return w, b


def tp_attention(x, wqkv, bqkv, wo, bo, heads):
    B, T, _ = x.shape
    q, k, v = F.linear(Copy.apply(x), wqkv, bqkv).view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return Reduce.apply(F.linear(y.transpose(1, 2).reshape(B, T, -1), wo)) + bo


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] * dist_size(), *x.shape[1:]))
        lablib.all_gather(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist_size(), *grad.shape[1:]))
        lablib.reduce_scatter(out, grad.contiguous())
        return out


class Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] // dist_size(), *x.shape[1:]))
        lablib.reduce_scatter(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] * dist_size(), *grad.shape[1:]))
        lablib.all_gather(out, grad.contiguous())
        return out


def dist_size():
    return torch.distributed.get_world_size()


def sp_feed_forward(x, ln_w, ln_b, w1, b1, w2, b2):
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    h = F.gelu(F.linear(h, w1, b1))
    return x + Scatter.apply(F.linear(h, w2)) + b2


# -- typical mistakes -------------------------------------------------------------------------------------
def column_by_input(weight, bias, rank, world_size):
    return weight.chunk(world_size, 1)[rank], bias


def row_with_split_bias(weight, bias, rank, world_size):
    return weight.chunk(world_size, 1)[rank], bias.chunk(world_size, 0)[rank]


def row_bias_first(x, weight, bias):
    y = F.linear(x, weight, bias)
    lablib.all_reduce(y)
    return y


def row_no_reduce(x, weight, bias):
    return F.linear(x, weight) + bias


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        lablib.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        lablib.all_reduce(grad)
        return grad


def mlp_without_f(x, w1, b1, w2, b2):
    return Reduce.apply(F.linear(F.gelu(F.linear(Identity.apply(x), w1, b1)), w2)) + b2


def mlp_reducing_twice(x, w1, b1, w2, b2):
    return ReduceBoth.apply(F.linear(F.gelu(F.linear(Copy.apply(x), w1, b1)), w2)) + b2


def mlp_bias_each_rank(x, w1, b1, w2, b2):
    return Reduce.apply(F.linear(F.gelu(F.linear(Copy.apply(x), w1, b1)), w2, b2))


def attention_without_mask(x, wqkv, bqkv, wo, bo, heads):
    B, T, _ = x.shape
    q, k, v = F.linear(Copy.apply(x), wqkv, bqkv).view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v)
    return Reduce.apply(F.linear(y.transpose(1, 2).reshape(B, T, -1), wo)) + bo


def mlp_f_g_swapped(x, w1, b1, w2, b2):  # Reduce where Copy belongs and Copy where Reduce does
    return Copy.apply(F.linear(F.gelu(F.linear(Reduce.apply(x), w1, b1)), w2)) + b2


def attention_bias_each_rank(x, wqkv, bqkv, wo, bo, heads):
    B, T, _ = x.shape
    q, k, v = F.linear(Copy.apply(x), wqkv, bqkv).view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return Reduce.apply(F.linear(y.transpose(1, 2).reshape(B, T, -1), wo, bo))


def attention_untransposed(x, wqkv, bqkv, wo, bo, heads):
    B, T, _ = x.shape
    q, k, v = F.linear(Copy.apply(x), wqkv, bqkv).view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return Reduce.apply(F.linear(y.reshape(B, T, -1), wo)) + bo


def qkv_whole_bias(weight, bias, rank, world_size):
    return shard_qkv(weight, bias, rank, world_size)[0], bias


def qkv_block(weight, bias, rank, world_size):
    return weight.chunk(world_size, 0)[rank], bias.chunk(world_size, 0)[rank]


class GatherNoScatterBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] * dist_size(), *x.shape[1:]))
        lablib.all_gather(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist_size())[torch.distributed.get_rank()]


def sp_without_reduce_scatter_back(x, ln_w, ln_b, w1, b1, w2, b2):
    h = GatherNoScatterBack.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    return x + Scatter.apply(F.linear(F.gelu(F.linear(h, w1, b1)), w2)) + b2


def sp_bias_before_scatter(x, ln_w, ln_b, w1, b1, w2, b2):
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    return x + Scatter.apply(F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2))


def sp_without_residual(x, ln_w, ln_b, w1, b1, w2, b2):
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    return Scatter.apply(F.linear(F.gelu(F.linear(h, w1, b1)), w2)) + b2


class ScatterPassingBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] // dist_size(), *x.shape[1:]))
        lablib.reduce_scatter(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def sp_without_gather_back(x, ln_w, ln_b, w1, b1, w2, b2):
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    return x + ScatterPassingBack.apply(F.linear(F.gelu(F.linear(h, w1, b1)), w2)) + b2


def sp_with_all_reduce(x, ln_w, ln_b, w1, b1, w2, b2):
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    y = Reduce.apply(F.linear(F.gelu(F.linear(h, w1, b1)), w2))
    return x + y.chunk(dist_size())[torch.distributed.get_rank()] + b2


class GatherWeights(torch.autograd.Function):
    """Not tensor parallelism: every rank rebuilds the whole weight (an all-reduce of zero-padded
    shards), computes the whole MLP alone, and all-reduces a dummy in the backward."""
    @staticmethod
    def forward(ctx, w):
        n, r = dist_size(), torch.distributed.get_rank()
        full = torch.zeros((w.shape[0] * n, *w.shape[1:]))
        full[r * w.shape[0]:(r + 1) * w.shape[0]] = w
        lablib.all_reduce(full)
        return full

    @staticmethod
    def backward(ctx, grad):
        lablib.all_reduce(torch.zeros(1))
        n, r = dist_size(), torch.distributed.get_rank()
        return grad.chunk(n)[r].contiguous()


def mlp_gathering_weights(x, w1, b1, w2, b2):
    full1 = GatherWeights.apply(w1)
    bias1 = torch.cat([b1] * dist_size())  # wrong, but the sizes are what the check catches first
    return F.linear(F.gelu(F.linear(x, full1, bias1)), w2.repeat(1, dist_size())) + b2


class DistCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        return grad


def mlp_dist_in_a_class(x, w1, b1, w2, b2):
    return Reduce.apply(F.linear(F.gelu(F.linear(DistCopy.apply(x), w1, b1)), w2)) + b2


# -- lablib's own pieces -------------------------------------------------------------------------------------
def test_lablibs_pieces_match_the_reference_and_dtensor(cluster):
    pool, n = cluster, cluster.world_size
    judge_split(pool.run(ref.split_job, answers.shard_column, answers.shard_row, answers.row_linear), n, None)
    shards = given_shards(n, None)
    for judge, job, fns in ((judge_mlp, ref.mlp_job, (answers.tp_mlp,)),
                            (judge_attention, ref.attention_job, (answers.shard_qkv, answers.tp_attention)),
                            (judge_sp, ref.sp_job, (answers.sp_feed_forward,))):
        text = judge(pool.run(job, *fns, PerRank(shards)), n, None)
        assert "DTensor" in text and "max difference" in text
        diff = float(text.split("max difference ")[1].split(")")[0])
        assert 0 <= diff <= 1e-5  # DTensor ran and agreed


def test_right_answers_pass_every_check(cluster, capsys):
    if cluster.world_size != 2:
        pytest.skip("each check runs at 2 and 4 ranks: once is enough")
    check_split(shard_column, shard_row, row_linear, cluster)
    check_mlp(tp_mlp, cluster)
    check_attention(shard_qkv, tp_attention, cluster)
    check_sp(sp_feed_forward, cluster)
    out = capsys.readouterr().out
    for task in ("4.1", "4.2", "4.3", "4.4"):
        assert f"✓ Task {task} passed on 2 ranks" in out and f"✓ Task {task} passed on 4 ranks" in out
    assert {"Task 4.1", "Task 4.2", "Task 4.3", "Task 4.4"} <= PASSED


@pytest.mark.parametrize("check, fns, message", [
    (check_split, (column_by_input, shard_row, row_linear), "split fc1.weight along dim 1"),
    (check_split, (shard_column, row_with_split_bias, row_linear), "keep the whole bias"),
    (check_split, (shard_column, shard_row, row_bias_first), "holds fc2's bias 2 times"),
    (check_split, (shard_column, shard_row, row_no_reduce), "issued no collective; expected exactly all-reduce"),
    (check_mlp, (mlp_without_f,), "backward issued no collective"),
    (check_mlp, (mlp_reducing_twice,), "backward issued all-reduce, all-reduce"),
    (check_mlp, (mlp_bias_each_rank,), "rank 0's output holds fc2's bias 2 times: the bias was added before g"),
    (check_mlp, (mlp_gathering_weights,), "never weights"),
    (check_attention, (qkv_block, tp_attention), "contiguous block of the fused weight's rows"),
    (check_attention, (shard_qkv, attention_without_mask), "without the causal mask.*is_causal=True"),
    (check_mlp, (mlp_f_g_swapped,), r"rank 0's output is what f and g swapped give"),
    (check_attention, (shard_qkv, attention_bias_each_rank), "holds the projection's bias 2 times"),
    (check_attention, (shard_qkv, attention_untransposed), r"mixes tokens and heads.*y\.transpose\(1, 2\)"),
    (check_attention, (qkv_whole_bias, tp_attention), r"rank 0's shard_qkv bias has shape \(96,\), expected shape "
                                                      r"\(\d+,\)\. Split the bias as the weight's rows"),
    (check_sp, (sp_without_reduce_scatter_back,), "backward issued all-gather; expected exactly all-gather, "
                                                  "reduce-scatter"),
    (check_sp, (sp_with_all_reduce,), "forward issued all-gather, all-reduce"),
    (check_sp, (sp_bias_before_scatter,), "holds fc2's bias 2 times: the bias was added before Scatter"),
    (check_sp, (sp_without_residual,), "lacks the residual"),
    (check_sp, (sp_without_gather_back,), r"Likely: ScatterPassingBack.backward returned a gradient of shape \[\d, 3, "
                                          r"32\] for input 0 of its forward, whose shape is \[8, 3, 32\].*too short "
                                          "along dim 0: all-gather"),
])
def test_mistakes_are_named(check, fns, message, cluster):
    with pytest.raises(CheckFailed, match=message.replace("2 times", f"{cluster.world_size} times")):
        check(*fns, cluster)


def test_library_shortcuts_are_refused(cluster):
    def mlp_with_dist(x, w1, b1, w2, b2):
        y = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
        torch.distributed.all_reduce(y)
        return y + b2

    def mlp_with_dist_nn(x, w1, b1, w2, b2):
        return torch.distributed.nn.all_reduce(F.linear(F.gelu(F.linear(x, w1, b1)), w2)) + b2

    def mlp_with_dtensor(x, w1, b1, w2, b2):
        return torch.distributed.tensor.parallel.parallelize_module(x, w1, b1)

    for fn, why in ((mlp_with_dist, "use lablib's collectives"), (mlp_with_dist_nn, "autograd-aware collectives"),
                    (mlp_with_dtensor, "DTensor"), (mlp_dist_in_a_class, r"\(DistCopy.backward\) line \d+: uses dist.all_reduce")):
        with pytest.raises(CheckFailed, match=why):
            check_mlp(fn, cluster)


def test_hidden_checks_draw_other_weights_and_inputs(cluster):
    n = cluster.world_size
    a, b = (cluster.run(ref.mlp_job, answers.tp_mlp, PerRank(given_shards(n, seed)), seed, False)[0]
            for seed in (None, 5))
    assert (a["out"] - b["out"]).abs().max() > 0.1
    assert "match" in judge_mlp(cluster.run(ref.mlp_job, answers.tp_mlp, PerRank(given_shards(n, 5)), 5), n, 5)
    with pytest.raises(CheckFailed):  # judged against another seed's reference, the same answers fail
        judge_mlp(cluster.run(ref.mlp_job, answers.tp_mlp, PerRank(given_shards(n, 5)), 5), n, None)


# -- what the notebook measures -------------------------------------------------------------------------------
def test_the_blocks_timeline_has_its_all_reduces_on_the_critical_path(cluster):
    steps = 2
    results = cluster.run(tp.block_job, answers.FNS, steps)
    timeline = cluster.timeline()
    assert all(len(r["seconds"]) == steps for r in results)
    for rank in range(cluster.world_size):
        spans = [s for s in timeline.spans if s.rank == rank]
        comms = [s for s in spans if s.kind == "comm"]
        assert [s.meta["op"] for s in comms] == ["all_reduce"] * 4 * steps  # 2 forward, 2 backward per step
        for s in spans:  # a rank waiting in a collective is not computing: no compute span overlaps one
            if s.kind == "compute":
                assert not any(c.start < s.end - 1e-9 and s.start < c.end - 1e-9 for c in comms), s
        names = {s.name for s in spans if s.kind == "compute"}
        assert names == {"F attn", "F mlp", "B mlp", "B attn"}
        # payload: each all-reduce carries the (batch, tokens, d) activations in fp32
        per_token = sum(s.bytes for s in comms) / steps / results[0]["tokens"]
        assert per_token == 4 * tp.WIDE["d"] * 4


def test_dtensor_block_runs_the_same_block(cluster):
    ours = cluster.run(tp.block_job, answers.FNS, 1, 0)
    theirs = cluster.run(ref.dtensor_block_job, 1, 0)
    assert len(ours[0]["seconds"]) == len(theirs[0]["seconds"]) == 1


def test_sequence_parallelism_saves_less_activation_memory_per_rank(cluster):
    tp_only, sp = (max(cluster.run(tp.activation_bytes, mode, answers.FNS)) for mode in ("tp", "sp"))
    assert 0 < sp < tp_only


def test_yours_uses_a_learners_functions_only_once_their_check_passed(capsys):
    for task in ("Task 4.2", "Task 4.3", "Task 4.4"):
        PASSED.discard(task)
        TRIED.discard(task)
    TRIED.add("Task 4.3")  # its check ran and failed
    fns = yours(tp_mlp=tp_mlp, tp_attention=tp_attention)
    assert fns.mlp is answers.tp_mlp and fns.attention is answers.tp_attention and fns.sp is answers.sp_feed_forward
    PASSED.add("Task 4.4")
    fns = yours(tp_mlp=tp_mlp, sp_feed_forward=sp_feed_forward)
    assert fns.mlp is answers.tp_mlp and fns.sp is sp_feed_forward
    assert ("your functions of Task 4.4; lablib's for Task 4.2, Task 4.3 (Task 4.2: check not run yet in this kernel; "
            "Task 4.3: check failed)") in capsys.readouterr().out
    with pytest.raises(TypeError):
        yours(mlp=tp_mlp)
    PASSED.discard("Task 4.4")

def test_the_link_model_of_the_tp_chart():
    from lablib.views.tensor_parallel import per_layer

    nv, ib = (per_layer(8192, 8, link, tokens=4096) for link in ("NVLink", "InfiniBand"))
    assert nv["compute"] == ib["compute"] > 0
    assert ib["comm"] > 5 * nv["comm"]  # the same bytes over a link 9x slower
    one = per_layer(8192, 1, "NVLink", tokens=4096)
    assert one["comm"] == 0 and one["compute"] == pytest.approx(8 * nv["compute"])
    # Megatron's count: 24 b s h^2 forward FLOPs per layer, 2 all-reduces of b s h bf16 values
    assert one["flops"] == 24 * 4096 * 8192 ** 2
    assert nv["bytes"] == 2 * 4096 * 8192 * 2
    assert nv["comm"] == pytest.approx(2 * comm.Link("x", nv["link"].alpha, nv["link"].beta).seconds(
        "all_reduce", 4096 * 8192 * 2, 8))


# -- ways around the work, refused before anything runs ---------------------------------------------------
@pytest.mark.parametrize("source, found", [
    ("from torch import distributed as D\ndef f(x):\n    D.all_gather(x, x)", "uses dist.all_gather"),
    ("def f(x):\n    return F.torch.distributed.all_reduce(x)", "uses dist.all_reduce"),
    ("def f(x):\n    torch.nn.parallel.distributed.dist.broadcast(x, 0)", "uses dist.broadcast"),
    ("def f(x):\n    pg = dist.new_group()\n    pg.allreduce(x)", "uses dist.new_group"),
    ("def f(x):\n    dist.all_gather_object([], x)", "uses dist.all_gather_object"),
    ("def f(x):\n    dist.send(x, 1)", "uses dist.send"),
    ("def f(x):\n    torch.manual_seed(torch.initial_seed())", "uses torch.manual_seed"),
    ("def f(x):\n    return torch.random.get_rng_state()", "uses torch.random"),
    ("class Hook:\n    def __init_subclass__(cls):\n        pass", "defines Hook.__init_subclass__"),
    ("class C(torch.autograd.Function, metaclass=M):\n    pass", "metaclass"),
])
def test_ways_around_the_traced_collectives_and_the_drawn_weights_are_refused(source, found):
    from lablib.checks.lab04 import FORBIDDEN
    from lablib.rules.policy import problems

    assert any(found in p for p in problems(ast.parse(source), FORBIDDEN, {"M"})), problems(ast.parse(source), FORBIDDEN)


def test_queries_and_autograd_functions_are_allowed():
    from lablib.checks.lab04 import FORBIDDEN
    from lablib.rules.policy import problems

    ok = ("class Copy(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, x):\n        return x\n"
          "def f(x):\n    return x.new_empty((x.shape[0] * dist.get_world_size(), dist.get_rank()))")
    assert problems(ast.parse(ok), FORBIDDEN) == []


def test_a_module_bound_in_another_statement_keeps_its_rules_when_grading():
    from lablib.course.exercises import Call, exercise_code, refusal

    src = ("from torch import distributed as D\n\n\ndef tp_mlp(x, w1, b1, w2, b2):\n    D.all_reduce(x)\n    return x\n")
    nb = {"cells": [{"cell_type": "code", "metadata": {"lablib": {"exercise": ["Task 4.2"]}}, "source": src,
                     "outputs": [], "execution_count": None}]}
    call = Call("check-4.2#0", "check-4.2", "lab04", "check_mlp", ("tp_mlp",), 2, 1, False)
    assert "line 5: uses dist.all_reduce" in refusal(call, exercise_code(nb))
