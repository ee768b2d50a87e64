"""Lab 07 (expert parallelism): lablib.all_to_all with uneven split sizes on real Gloo ranks (rows, the
bytes to each rank, a mismatch named), the dense layer token by token, the capacity rule and the balancing
loss against plain loops, the expert-parallel layer and the all-gather dispatcher against the dense layer,
and Tasks 7.1-7.5's checks on right answers and on every mistake their messages name."""
import math

import pytest
import torch
import torch.distributed as dist

import lablib
from lablib import comm
from lablib.answers import lab07 as A
from lablib.checks import CheckFailed
from lablib.checks.lab07 import check_a2a, check_dense, check_keep, check_layer, check_loss
from lablib.pool import RankError
from lablib.strategies import experts as ep
from lablib.strategies.prefetch import start_recording


# -- lablib.all_to_all with split sizes ---------------------------------------------------------------------
def _uneven_job(mismatch=False):
    r, n = dist.get_rank(), dist.get_world_size()
    ins = [r + 2 * j for j in range(n)]          # rows to rank j
    outs = [j + 2 * r for j in range(n)]         # rows from rank j: what rank j sends here
    x = lablib.to_device(torch.arange(sum(ins) * 2, dtype=torch.float32).view(-1, 2) + 100 * r)
    y = lablib.to_device(torch.empty(sum(ins if mismatch else outs), 2))
    start_recording()
    _, ops = comm.watched(lablib.all_to_all, y, x, ins if mismatch else outs, ins, peers=True)
    return {"y": y, "ops": ops, "ins": ins, "outs": outs}


def test_all_to_all_takes_uneven_splits_and_records_the_bytes_to_each_rank(cluster):
    results = cluster.run(_uneven_job)
    timeline = cluster.timeline()
    n = cluster.world_size
    for r, res in enumerate(results):
        want = torch.cat([torch.arange(sum(results[j]["ins"]) * 2, dtype=torch.float32).view(-1, 2)[
            sum(results[j]["ins"][:r]):sum(results[j]["ins"][:r + 1])] + 100 * j for j in range(n)])
        assert torch.equal(res["y"], want)
        assert res["ops"] == [f"all_to_all {sum(res['ins']) * 8} to {'/'.join(str(c * 8) for c in res['ins'])}"]
        (span,) = [s for s in timeline.spans if s.rank == r and s.kind == "comm"]
        assert span.meta["to"] == [c * 8 for c in res["ins"]] and span.meta["from"] == [c * 8 for c in res["outs"]]
        assert comm.bytes_sent(timeline, rank=r) == sum(c * 8 for j, c in enumerate(res["ins"]) if j != r)


def test_a_receiver_that_takes_its_own_sends_for_its_receives_is_told_which_rank_sends_what(cluster):
    with pytest.raises(RankError, match=r"output_split_sizes\[\d\] = \d+ rows, but rank \d sends \d+"):
        cluster.run(_uneven_job, True)
    assert cluster.run(_uneven_job)  # the ranks are fine after it


def _bad_splits_job(sizes):
    x = torch.zeros(4, 3)
    lablib.all_to_all(torch.empty(4, 3), x, [2] * dist.get_world_size(), sizes)


def test_split_sizes_that_do_not_fit_the_tensor_say_so(cluster):
    n = cluster.world_size
    with pytest.raises(RankError, match="expected .* whole numbers of rows, one per rank"):
        cluster.run(_bad_splits_job, [4])
    with pytest.raises(RankError, match=r"add up to \d+ rows, but input has 4"):
        cluster.run(_bad_splits_job, [3] * n)


# -- the single-process pieces against loops ------------------------------------------------------------------
def test_the_dense_layer_is_each_tokens_gated_experts_plus_itself():
    router, w1, w2 = ep.layer(8, 16, 6, seed=3)
    x = ep.tokens(10, 8, router, seed=1)
    out = A.moe_dense(x, router, w1, w2, 2)
    probs = torch.softmax(x @ router, -1)
    for t in range(10):
        top = sorted(range(6), key=lambda e: -probs[t, e])[:2]
        want = x[t] + sum(probs[t, e] * torch.relu(x[t] @ w1[e]) @ w2[e] for e in top)
        assert torch.allclose(out[t], want, atol=1e-6)


def _keep_by_loop(experts, gates, E, cap):
    pairs = [(t, j) for t in range(experts.shape[0]) for j in range(experts.shape[1])]
    keep = torch.zeros(experts.shape, dtype=torch.bool)
    for e in range(E):
        mine = sorted((p for p in pairs if experts[p] == e), key=lambda p: (-gates[p].item(), p[0]))
        for p in mine[:cap]:
            keep[p] = True
    return keep


@pytest.mark.parametrize("seed", range(4))
def test_the_capacity_rule_keeps_each_experts_highest_gates(seed):
    router, _, _ = ep.layer(8, 8, 4, seed=seed)
    gates, experts, _ = A.route(ep.tokens(20, 8, router, seed=seed, skew=2.0), router, 2)
    gates = (gates * 4).round() / 4  # ties
    for cap in (0, 3, 8, 40):
        assert torch.equal(A.keep_mask(experts, gates, 4, cap), _keep_by_loop(experts, gates, 4, cap))
    assert ep.capacity(4096, 2, 1.25, 64) == 160


def test_the_balancing_loss_is_alpha_when_even_and_alpha_e_when_collapsed():
    E = 8
    even = torch.full((16, E), 1 / E)
    assert A.load_balance_loss(even, torch.arange(16).view(16, 1) % E, E, 0.01).item() == pytest.approx(0.01)
    collapsed = torch.zeros(16, E)
    collapsed[:, 0] = 1
    assert A.load_balance_loss(collapsed, torch.zeros(16, 1, dtype=torch.long), E, 0.01).item() == pytest.approx(0.08)


def test_the_balancing_loss_and_deepseeks_bias_even_out_a_skewed_router():
    def imbalance(run):
        last = run["loads"][-1]
        return max(last) * len(last) / sum(last)

    runs = {a: ep.balance_run(A.route, A.moe_dense, A.load_balance_loss, a) for a in (0.0, 0.1)}
    bias = ep.balance_run(A.route, A.moe_dense, None, 0.0, bias_rate=0.003)
    assert imbalance(runs[0.0]) > 2 and imbalance(runs[0.1]) < 1.5 and imbalance(bias) < 1.2
    # the bias chooses the experts (here 0 and 5 for every token); the gates stay the unbiased probabilities
    router, w1, w2 = ep.layer(4, 8, 6, seed=1)
    x = ep.tokens(5, 4, router)
    probs = torch.softmax(x @ router, -1)
    want = x + sum(probs[:, e, None] * torch.relu(x @ w1[e]) @ w2[e] for e in (0, 5))
    got = A.moe_dense(x, router, w1, w2, 2, bias=torch.tensor([9.0, 0, 0, 0, 0, 9.0]))
    assert torch.allclose(got, want, atol=1e-6)


# -- on the ranks: the layer and the other dispatcher against the dense layer ---------------------------------
def _dispatcher_job(dispatcher):
    r, n = dist.get_rank(), dist.get_world_size()
    router, w1, w2 = ep.layer(8, 16, 2 * n, seed=2)
    x = ep.tokens(12, 8, router, seed=r, skew=1.0)
    x, router, w1, w2 = lablib.to_device(x, router, ep.local(w1, r, n), ep.local(w2, r, n))
    if dispatcher == "all_gather":
        return comm.watched(ep.allgather_moe, x, router, w1, w2, 2, A.route)
    return comm.watched(A.moe_layer, x, router, w1, w2, 2)


@pytest.mark.parametrize("dispatcher", ["all_to_all", "all_gather"])
def test_both_dispatchers_equal_the_dense_layer(cluster, dispatcher):
    n = cluster.world_size
    results = cluster.run(_dispatcher_job, dispatcher)
    router, w1, w2 = ep.layer(8, 16, 2 * n, seed=2)
    x = torch.cat([ep.tokens(12, 8, router, seed=r, skew=1.0) for r in range(n)])
    assert (torch.cat([out for out, _ in results]) - A.moe_dense(x, router, w1, w2, 2)).abs().max() < 1e-5
    ops = {op.split()[0] for _, calls in results for op in calls}
    assert ops == ({"all_to_all"} if dispatcher == "all_to_all" else {"all_gather", "reduce_scatter"})


def test_a_hot_experts_rank_computes_most_and_every_rank_records_its_layer(cluster):
    results = cluster.run(ep.moe_job, A.moe_layer, 3.0, 1, None, "all_to_all", A.route, tokens=512, dim=64, hidden=128)
    timeline = cluster.timeline()
    per_rank = [sum(r["rows"]) for r in results]
    assert per_rank[0] > 1.5 * max(per_rank[1:])  # expert 0, on rank 0, is hot
    assert sum(per_rank) == cluster.world_size * 512 * 2  # every assignment computed once
    for r in range(cluster.world_size):
        names = [s.name for s in sorted(timeline.spans, key=lambda s: s.start) if s.rank == r]
        assert sum(n.startswith("all_to_all") for n in names) == 3  # counts, dispatch, combine
        assert sum(n.startswith("expert ") for n in names) == 8 // cluster.world_size
        assert ep.bytes_matrix(timeline)[r] == [c * 64 * 4 for c in results[r]["to_rank"]]
    waits = ep.combine_wait(timeline)
    assert len(waits) == cluster.world_size and all(w >= 0 for w in waits)
    assert all(r["cpu"] > 0 for r in results)


def test_the_all_gather_dispatcher_sends_every_token_and_every_output(cluster):
    n, T, dim, k = cluster.world_size, 64, 32, 2
    runs = ep.dispatchers(cluster, A.moe_layer, A.route, rounds=2, steps=1, tokens=T, dim=dim, hidden=32)
    assert [len(r) for run in runs.values() for r in run["steps"]] == [1] * 4
    # each other rank gets rank 0's tokens, gates (fp32) and experts (int64); the reduce-scatter returns P-1 rows of T
    assert runs["all_gather"]["sent"] == (n - 1) * T * (2 * dim * 4 + k * (4 + 8))
    if n > k:  # P/k times the rows: the all-to-all sends fewer
        assert runs["all_to_all"]["sent"] < runs["all_gather"]["sent"]


# -- the checks: lablib's answers pass; typical mistakes are named ---------------------------------------------
def _judged(check, fns, pool=None, seed=None):
    n = pool.world_size if pool is not None else None
    return check.judge(check.collect(fns, pool, seed), n, seed)


def test_lablibs_answers_pass_every_check(cluster):
    for seed in (None, 1, 2, 3):
        assert "dense layer" in _judged(check_dense, (A.route, A.moe_dense), seed=seed)
        assert "highest gates" in _judged(check_keep, (A.keep_mask,), seed=seed)
        assert "α·E" in _judged(check_loss, (A.load_balance_loss,), seed=seed)
    assert "uneven splits" in _judged(check_a2a, (A.autograd_all_to_all,), cluster, seed=4)
    for seed in (None, 5):
        assert "counts first" in _judged(check_layer, (A.moe_layer,), cluster, seed=seed)


def route(x, router, k):
    probs = torch.softmax(x @ router, dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    return gates, experts, probs


def route_renormalised(x, router, k):
    gates, experts, probs = route(x, router, k)
    return gates / gates.sum(-1, keepdim=True), experts, probs


def _dense(x, router, w1, w2, k, power=1, residual=True):
    gates, experts, _ = route(x, router, k)
    out = x if residual else torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        out = out.index_add(0, token, gates[token, slot, None] ** power * lablib.expert(x[token], w1[e], w2[e]))
    return out


def dense(x, router, w1, w2, k):
    return _dense(x, router, w1, w2, k)


def dense_gated_twice(x, router, w1, w2, k):
    return _dense(x, router, w1, w2, k, power=2)


def dense_no_residual(x, router, w1, w2, k):
    return _dense(x, router, w1, w2, k, residual=False)


def test_router_and_dense_mistakes_are_named():
    assert "dense layer" in _judged(check_dense, (route, dense))
    with pytest.raises(CheckFailed, match="not renormalised"):
        check_dense(route_renormalised, dense)
    with pytest.raises(CheckFailed, match="applied twice"):
        check_dense(route, dense_gated_twice)
    with pytest.raises(CheckFailed, match="residual is missing"):
        check_dense(route, dense_no_residual)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits):
        ctx.splits = (output_splits, input_splits)
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        lablib.all_to_all(out, x.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        lablib.all_to_all(back, grad.contiguous(), input_splits, output_splits)
        return back, None, None


class AllToAllNotSwapped(AllToAll):
    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(output_splits),) + tuple(grad.shape[1:]))
        lablib.all_to_all(back, grad.contiguous(), output_splits, input_splits)
        return back, None, None


class AllToAllOneGradient(AllToAll):
    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        lablib.all_to_all(back, grad.contiguous(), input_splits, output_splits)
        return back


def a2a(x, output_splits, input_splits):
    return AllToAll.apply(x, output_splits, input_splits)


def a2a_not_swapped(x, output_splits, input_splits):
    return AllToAllNotSwapped.apply(x, output_splits, input_splits)


def a2a_one_gradient(x, output_splits, input_splits):
    return AllToAllOneGradient.apply(x, output_splits, input_splits)


def test_all_to_all_mistakes_are_named(cluster):
    assert "uneven splits" in _judged(check_a2a, (a2a,), cluster)
    with pytest.raises(CheckFailed, match="the same call with the two swapped"):
        check_a2a(a2a_not_swapped, cluster)
    with pytest.raises(CheckFailed, match="None for each of the two split lists"):
        check_a2a(a2a_one_gradient, cluster)


def keep_lowest(experts, gates, num_experts, capacity):
    return keep_highest(experts, -gates, num_experts, capacity)


def keep_highest(experts, gates, num_experts, capacity):
    flat_e, order = experts.flatten(), torch.argsort(-gates.flatten(), stable=True)
    keep = torch.zeros_like(flat_e, dtype=torch.bool)
    for e in range(num_experts):
        keep[order[flat_e[order] == e][:capacity]] = True
    return keep.view(experts.shape)


def keep_first_come(experts, gates, num_experts, capacity):
    flat_e = experts.flatten()
    keep = torch.zeros_like(flat_e, dtype=torch.bool)
    for e in range(num_experts):
        keep[(flat_e == e).nonzero().flatten()[:capacity]] = True
    return keep.view(experts.shape)


def test_capacity_mistakes_are_named():
    assert "highest gates" in _judged(check_keep, (keep_highest,))
    with pytest.raises(CheckFailed, match="highest-gate assignments"):
        check_keep(keep_lowest)
    with pytest.raises(CheckFailed, match=r"first \d+ assignments by position .* keeps each expert's highest gates"):
        check_keep(keep_first_come)


def _layer(x, router, w1, w2, k, capacity_factor=None, mistake=""):
    """A learner's layer, right, or with one mistake."""
    n, local = dist.get_world_size(), w1.shape[0]
    E = n * local
    gates, experts, _ = route(x, router, k)
    flat = experts.flatten()
    kept = torch.ones_like(flat, dtype=torch.bool)
    if capacity_factor is not None and mistake != "no capacity":
        cap = {"floor": lambda t, c: int(t * k * c / E), "every rank's tokens": lambda t, c: math.ceil(n * t * k * c / E),
               "no k": lambda t, c: math.ceil(t * c / E), "per rank": lambda t, c: math.ceil(t * k * c / n),
               }.get(mistake, lambda t, c: math.ceil(t * k * c / E))(x.shape[0], capacity_factor)
        kept = keep_highest(experts, gates, E, cap).flatten()
        if mistake != "send dropped":
            flat = torch.where(kept, flat, E)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E + 1)[:E]
    order = order[:int(counts.sum())]
    got = torch.empty_like(counts)
    lablib.all_to_all(got, counts)
    per = (counts if mistake == "sender's view" else got).view(n, local)
    send, recv = counts.view(n, local).sum(1).tolist(), per.sum(1).tolist()
    if mistake == "plain dispatch":
        arrived = torch.empty(sum(recv), x.shape[1])
        lablib.all_to_all(arrived, x[order // k].contiguous(), recv, send)
    else:
        arrived = AllToAll.apply(x[order // k], *((send, recv) if mistake == "swapped" else (recv, send)))
    owner = torch.arange(local).repeat(n).repeat_interleave(per.flatten())
    regroup = owner.argsort(stable=True)
    done = torch.cat([lablib.expert(p, w1[e], w2[e]) for e, p in enumerate(arrived[regroup].split(per.sum(0).tolist()))])
    back = torch.empty_like(done)
    back[regroup] = done
    returned = AllToAll.apply(back, send, recv)
    if mistake == "not inverted":
        y = torch.zeros(flat.shape[0], x.shape[1]).index_copy(0, torch.arange(len(order)), returned)
    else:
        y = torch.zeros(flat.shape[0], x.shape[1]).index_copy(0, order, returned)
    if mistake == "send dropped":
        y = y * kept[:, None]
    out = x + (y.view(-1, k, x.shape[1]) * gates[..., None]).sum(1)
    if mistake == "dropped lost":
        out = out * kept.view(-1, k).any(1, keepdim=True)
    return out


def layer(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor)


def layer_senders_view(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "sender's view")


def layer_not_inverted(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "not inverted")


def layer_sends_dropped(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "send dropped")


def layer_loses_dropped(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "dropped lost")


def layer_without_capacity(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "no capacity")


def layer_plain_dispatch(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "plain dispatch")


def layer_swapped_splits(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "swapped")


def layer_capacity_floored(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "floor")


def layer_capacity_of_every_rank(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "every rank's tokens")


def layer_capacity_without_k(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "no k")


def layer_capacity_per_rank(x, router, w1, w2, k, capacity_factor=None):
    return _layer(x, router, w1, w2, k, capacity_factor, "per rank")


def layer_gathered(x, router, w1, w2, k, capacity_factor=None):
    every = torch.empty((dist.get_world_size() * x.shape[0],) + tuple(x.shape[1:]))
    lablib.all_gather(every, x)
    return x


def test_layer_mistakes_are_named(cluster):
    assert "counts first" in _judged(check_layer, (layer,), cluster)
    with pytest.raises(CheckFailed, match="exchange the counts first"):
        check_layer(layer_senders_view, cluster)
    with pytest.raises(CheckFailed, match="went back to the wrong tokens"):
        check_layer(layer_not_inverted, cluster)
    with pytest.raises(CheckFailed, match="once per kept assignment"):
        check_layer(layer_sends_dropped, cluster)
    with pytest.raises(CheckFailed, match="came out as zeros; they pass through"):
        check_layer(layer_loses_dropped, cluster)
    with pytest.raises(CheckFailed, match="the other dispatcher"):
        check_layer(layer_gathered, cluster)
    with pytest.raises(CheckFailed, match="the layer without a capacity"):
        check_layer(layer_without_capacity, cluster)
    with pytest.raises(CheckFailed, match="a plain lablib.all_to_all cuts the graph"):
        check_layer(layer_plain_dispatch, cluster)


@pytest.mark.parametrize("fn, seed, message", [
    (layer_swapped_splits, None, r"Likely: the dispatch's split sizes are swapped\. autograd_all_to_all\(tokens, output_"),
    (layer_capacity_floored, None, r"rounded down: .* takes 8 of this rank's assignments here, not 7"),
    (layer_capacity_without_k, None, r"leaves out k: .* takes 6 of this rank's assignments here, not 3"),
    (layer_capacity_per_rank, None, r"per expert, not per rank: .* takes 6 of this rank's assignments here, not 12"),
    (layer_capacity_of_every_rank, None, r"nothing was dropped: .* from every rank's tokens, .* world_size times too large"),
    (layer_capacity_of_every_rank, 15, r"world_size times too large: count this rank's tokens only"),  # 12 experts, top-1
])
def test_layer_split_and_capacity_mistakes_are_named(cluster, fn, seed, message):
    if cluster.world_size != 4 and seed is None and fn is not layer_swapped_splits:
        pytest.skip("these capacities keep other assignments than the right one with 8 experts, on 4 ranks")
    with pytest.raises(CheckFailed, match=message):
        _judged(check_layer, (fn,), cluster, seed=seed)


def loss_not_over_k(probs, experts, num_experts, alpha):
    f = torch.bincount(experts.flatten(), minlength=num_experts).float() / experts.shape[0]
    return alpha * num_experts * (f * probs.mean(0)).sum()


def loss_f_from_probs(probs, experts, num_experts, alpha):
    f = torch.bincount(experts.flatten(), minlength=num_experts).float() / experts.numel()
    f = f + probs.mean(0) - probs.mean(0).detach()  # the same value, a gradient through f too
    return alpha * num_experts * (f * probs.mean(0)).sum()


def loss_mean_over_experts(probs, experts, num_experts, alpha):
    f = torch.bincount(experts.flatten(), minlength=num_experts).float() / experts.numel()
    return alpha * num_experts * (f * probs.mean(1)).sum()


def test_loss_mistakes_are_named():
    with pytest.raises(CheckFailed, match="divide by tokens × k"):
        check_loss(loss_not_over_k)
    with pytest.raises(CheckFailed, match="gradient is not"):
        check_loss(loss_f_from_probs)
    with pytest.raises(CheckFailed, match=r"averaged over the experts \(probs.mean\(1\).*probs.mean\(0\)"):
        check_loss(loss_mean_over_experts)
