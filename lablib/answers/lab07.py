"""Lab 07's answers: the top-k router and the dense mixture in one process, an all-to-all autograd goes
through, the expert-parallel layer (counts, then tokens, then experts, then back), the capacity rule and
the load-balancing loss (the harness, ``expert`` and the layer's weights, is ``strategies.experts``)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from .. import comm
from ..strategies.experts import capacity, expert

TASKS = {"Task 7.1": ("route", "moe_dense"), "Task 7.2": ("AllToAll", "autograd_all_to_all"), "Task 7.3": ("keep_mask",),
         "Task 7.4": ("moe_layer",), "Task 7.5": ("load_balance_loss",)}


def route(x, router, k: int):
    """(gates, experts, probs): the router's softmax over experts (tokens, E), and each token's k highest
    probabilities and their experts (tokens, k), not renormalised."""
    probs = torch.softmax(x @ router, dim=-1)
    gates, experts = probs.topk(k, dim=-1)
    return gates, experts, probs


def moe_dense(x, router, w1, w2, k: int, keep=None, bias=None):
    """The layer in one process, every expert here: x + each token's gate-weighted top-k experts' outputs.
    ``keep`` (tokens, k): which assignments count (the capacity rule's, applied per rank by the caller).
    ``bias`` (E,): DeepSeek-V3's balancing bias, added to the probabilities to choose the experts only; the
    gates stay the unbiased probabilities."""
    gates, experts, probs = route(x, router, k)
    if bias is not None:
        experts = (probs + bias).topk(k, dim=-1).indices
        gates = probs.gather(1, experts)
    if keep is not None:
        gates = gates * keep
    out = x.clone()
    for e in range(w1.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        out = out.index_add(0, token, gates[token, slot, None] * expert(x[token], w1[e], w2[e]))
    return out


class AllToAll(Function):
    """An all-to-all with split sizes that autograd goes through: the backward sends each gradient row back
    where its row came from (the same all-to-all with the splits swapped)."""
    @staticmethod
    def forward(ctx, x, output_splits, input_splits):
        ctx.splits = (output_splits, input_splits)
        out = x.new_empty((sum(output_splits),) + x.shape[1:])
        comm.all_to_all(out, x.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits),) + grad.shape[1:])
        comm.all_to_all(back, grad.contiguous(), input_splits, output_splits)
        return back, None, None


def autograd_all_to_all(x, output_splits, input_splits):
    """``AllToAll`` as a function (as ``torch.distributed.nn.functional.all_to_all_single`` wraps its own)."""
    return AllToAll.apply(x, output_splits, input_splits)


def moe_layer(x, router, w1, w2, k: int, capacity_factor=None):
    """This rank's tokens x (tokens, dim) through the layer whose E = P·(E/P) experts are spread over the
    ranks (w1, w2: this rank's E/P). Route; sort the (token, expert) assignments by expert; exchange the
    counts; send the tokens; regroup what arrived rank-major into expert-major; run the local experts;
    send the outputs back; undo the sort; weight by the gates. With ``capacity_factor``, only the
    assignments ``keep_mask`` keeps are sent."""
    n, local = dist.get_world_size(), w1.shape[0]
    E = n * local
    gates, experts, _ = route(x, router, k)
    flat = experts.flatten()                                           # (tokens·k,): assignment j = token j // k
    if capacity_factor is not None:
        kept = keep_mask(experts, gates, E, capacity(x.shape[0], k, capacity_factor, E)).flatten()
        flat = torch.where(kept, flat, E)                              # dropped: sorted past the last expert
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E + 1)[:E]                 # assignments to each expert, sent
    order = order[:int(counts.sum())]
    got = torch.empty_like(counts)
    comm.all_to_all(got, counts, name="all_to_all counts")            # got[j·local + e]: rank j's to my expert e
    send, recv = counts.view(n, local).sum(1).tolist(), got.view(n, local).sum(1).tolist()
    arrived = autograd_all_to_all(x[order // k], recv, send)          # rank-major: rank 0's (expert 0, 1, ..), rank 1's
    by_rank = got.view(n, local)
    owner = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), by_rank.flatten())
    regroup = owner.argsort(stable=True)                               # expert-major
    done = torch.cat([expert(part, w1[e], w2[e])
                      for e, part in enumerate(arrived[regroup].split(by_rank.sum(0).tolist()))])
    back = torch.empty_like(done)
    back[regroup] = done                                               # rank-major again
    returned = autograd_all_to_all(back, send, recv)
    y = torch.zeros(flat.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    y = y.index_copy(0, order, returned)                               # assignment order; dropped rows stay 0
    return x + (y.view(-1, k, x.shape[1]) * gates[..., None]).sum(1)


def keep_mask(experts, gates, num_experts: int, capacity: int):
    """(tokens, k) bools: each expert keeps at most ``capacity`` of this rank's assignments to it, the
    highest gates (ties: the earlier token), and drops the rest."""
    flat_e, flat_g = experts.flatten(), gates.flatten()
    order = torch.argsort(-flat_g, stable=True)                        # highest gate first
    by_expert = order[torch.argsort(flat_e[order], stable=True)]       # grouped by expert, gate order kept
    e_sorted = flat_e[by_expert]
    start = torch.searchsorted(e_sorted, torch.arange(num_experts, device=e_sorted.device))
    rank_in = torch.arange(e_sorted.shape[0], device=e_sorted.device) - start[e_sorted]
    keep = torch.zeros_like(flat_e, dtype=torch.bool)
    keep[by_expert] = rank_in < capacity
    return keep.view(experts.shape)


def load_balance_loss(probs, experts, num_experts: int, alpha: float):
    """Switch Transformer's auxiliary loss α·E·Σᵢ fᵢ·Pᵢ: fᵢ the fraction of this rank's assignments that go
    to expert i (a count: no gradient), Pᵢ the mean router probability of expert i."""
    f = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype) / experts.numel()
    return alpha * num_experts * (f * probs.mean(0)).sum()
