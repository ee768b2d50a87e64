"""Lab 07's data and Task 7.4's rank job and judgement: the inputs every check builds from a seed, the
expert-parallel layer run forward and backward on the ranks with the calls it made, and the comparison with
the dense layer and with the bytes the routing sends (``checks.lab07`` holds the checks)."""
from __future__ import annotations

import random

import torch

from ..pool import PerRank
from ..strategies import experts as ep
from ..toy import generator
from . import CheckFailed, answers, max_error

TOL = 1e-5
FORBIDDEN = {
    "dist.*": "exercises move data with lablib's traced collectives only (lablib.all_to_all); of torch.distributed "
              "they may ask get_rank and get_world_size",
    "dist.nn": "torch.distributed.nn's autograd-aware all-to-all is what Task 7.2 builds; use your AllToAll",
    "~all_gather": "gathering every token is the other dispatcher, the one the lab compares with: send each token "
                   "only to its experts' ranks, with lablib.all_to_all",
}


def shape(seed, world_size: int) -> dict:
    """tokens per rank, dim, hidden, experts (E, a multiple of the ranks) and k."""
    if seed is None:
        return dict(tokens=24, dim=16, hidden=32, experts=2 * world_size, k=2)
    rng = random.Random(seed)
    return dict(tokens=rng.choice((16, 20, 28)), dim=rng.choice((8, 16)), hidden=24,
                experts=world_size * rng.choice((1, 2, 3)), k=rng.choice((1, 2)))


def inputs(seed, world_size: int, rank: int, skew: float = 0.0) -> tuple:
    """(x of this rank, router, w1, w2 of every expert, grad of the output), built on the CPU from the seed."""
    s = shape(seed, world_size)
    router, w1, w2 = ep.layer(s["dim"], s["hidden"], s["experts"], seed=seed or 0)
    x = ep.tokens(s["tokens"], s["dim"], router, seed=rank + 100 * (seed or 0), skew=skew)
    g = torch.randn(x.shape, generator=generator(7 + rank + 100 * (seed or 0)))
    return x, router, w1, w2, g


A2A_HINTS = (
    ("_split_sizes", "forward(ctx, x, output_splits, input_splits) sends with lablib.all_to_all(out, x, "
                           "output_splits, input_splits); the backward sends the gradient back where each row came "
                           "from: the same call with the two swapped."),
    ("incorrect number of gradients", "backward returns one gradient per input of forward: the gradient of x, then "
                                      "None for each of the two split lists."),
    ("does not require grad", "the output must come out of your Function's forward (return AllToAll.apply(...)), "
                              "for autograd to call its backward."),
)


def bytes_to(op: str):
    """The bytes to each rank of a watched all-to-all ("all_to_all 96 to 32/64"); None for another call."""
    parts = op.split()
    return [int(b) for b in parts[3].split("/")] if parts[0] == "all_to_all" and len(parts) == 4 else None


def name_output_mistake(task, y, x, router, w1, w2, k, keep=None, capacity_factor=None, world_size=None):
    """CheckFailed naming the mistake when the output ``y`` of one rank's tokens ``x`` (its ``keep``, with a
    capacity) is what a typical mistake gives; ``w1``, ``w2``: every expert's."""
    A = answers("lab07")
    gates, experts, _ = A.route(x, router, k)
    outs = torch.stack([torch.stack([ep.expert(x[t:t + 1], w1[e], w2[e])[0] for e in experts[t].tolist()])
                        for t in range(x.shape[0])])                                    # (tokens, k, dim)
    mistakes = {}
    if keep is not None:
        E, T = w1.shape[0], x.shape[0]
        right = ep.capacity(T, k, capacity_factor, E)
        nothing = ("nothing was dropped: this is the layer without a capacity. With a capacity_factor, compute "
                   f"the capacity, ⌈tokens × k × factor / E⌉ = {right} here, from this rank's tokens (x.shape[0]) and "
                   "all E = world_size × w1.shape[0] experts (a capacity from every rank's tokens, or from this rank's "
                   "w1.shape[0] experts, is world_size times too large and may drop nothing), keep only the "
                   "assignments keep_mask keeps, and send only those")
        mistakes[nothing] = x + (outs * gates[..., None]).sum(1)
        for wrong, what in (
                (int(T * k * capacity_factor / E), "the capacity was rounded down: ⌈tokens × k × factor / E⌉ rounds "
                                                   "up (math.ceil; int() and // round down)"),
                (ep.capacity(T, 1, capacity_factor, E), "the capacity leaves out k: each token makes k assignments, "
                                                        "so an expert's even share is tokens × k / E"),
                (ep.capacity(T, k, capacity_factor, world_size), "the capacity is per expert, not per rank: divide "
                                                                 "by E, every expert, not by the number of ranks"),
                (ep.capacity(T * world_size, k, capacity_factor, E),
                 "the capacity is world_size times too large: count this rank's tokens only (x.shape[0]), and take E "
                 "as every expert (world_size × w1.shape[0], not w1.shape[0])")):
            kept = A.keep_mask(experts, gates, E, wrong)
            if wrong != right and not torch.equal(kept, keep):
                what = f"{what}: an expert takes {right} of this rank's assignments here, not {wrong}"
                mistakes.setdefault(what, x + (outs * (gates * kept)[..., None]).sum(1))
        gates = gates * keep
    mixed = (outs * gates[..., None]).sum(1)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    sorted_outs = outs.flatten(0, 1)[order]
    twice = sorted_outs[order].view_as(outs)
    mistakes |= {
        "the gates were applied twice: the output weights each expert by its gate squared. Multiply by the gate "
        "once, after the combine, on the token's own rank": x + (outs * gates[..., None] ** 2).sum(1),
        "the residual is missing: a token's output is x plus its experts' weighted outputs (a token all of whose "
        "assignments were dropped comes out as itself)": mixed,
        "the expert outputs went back to the wrong tokens: the order the assignments were sorted in was not undone. "
        "To undo `sorted = y[order]`, write `y[order] = sorted` (a scatter), not `sorted[order]`":
            x + (sorted_outs.view_as(outs) * gates[..., None]).sum(1),
        "the expert outputs went back to the wrong tokens: the sort by expert was applied a second time instead of "
        "undone. To undo `sorted = y[order]`, write `y[order] = sorted`": x + (twice * gates[..., None]).sum(1),
    }
    for what, wrong in mistakes.items():
        if (y - wrong).abs().max() < TOL:
            raise CheckFailed(f"{task}: {what}.")


def layer_shares(seed, n: int, skew: float = 0.0) -> PerRank:
    """Each rank's share: its tokens, the router, its own experts' weights and its output's gradient, made here
    from the seed (no rank gets the seed, or another rank's tokens)."""
    out = []
    for r in range(n):
        x, router, w1, w2, g = inputs(seed, n, r, skew)
        out.append((x, router, ep.local(w1, r, n), ep.local(w2, r, n), g))
    return PerRank(out)


def layer_job(fn, share: tuple, k: int, capacity_factor=None) -> dict:
    """On each rank: the learner's layer forward and backward on this rank's tokens (``share``), with the calls it
    made (each all-to-all's bytes to each rank) and the tokens of each lablib.expert call."""
    from ..comm import to_device, watched

    x, router, w1, w2, g = share
    leaves = [t.requires_grad_() for t in to_device(x, router, w1, w2)]
    g = to_device(g)

    def step():
        y = fn(*leaves, k) if capacity_factor is None else fn(*leaves, k, capacity_factor)
        if isinstance(y, torch.Tensor) and y.shape == g.shape and y.requires_grad:
            (y * g).sum().backward()
        return y.detach() if isinstance(y, torch.Tensor) else y

    (y, ops), rows = ep.rows_of(watched, step, peers=True)
    return {"y": y, "grads": [t.grad for t in leaves], "ops": ops, "rows": rows}


LAYER_HINTS = (
    ("output_split_sizes[", "a rank's output splits are what the others send it: exchange the counts first "
                           "(lablib.all_to_all of the per-expert counts) and receive with the counts that arrived."),
    ("whole numbers of rows, one per rank", "a split list is one number of rows per rank: sum the per-expert counts "
                                            "over each rank's experts (counts.view(world_size, -1).sum(1))."),
    ("input_split_sizes=", "the dispatch's split sizes are swapped. autograd_all_to_all(tokens, output_splits, "
                           "input_splits) takes what arrives first: output_splits, per rank, the counts that arrived "
                           "from it (summed over your experts); input_splits, per rank, your own counts for its experts "
                           "(they add up to the tokens you send). The combine sends the results home with the two "
                           "exchanged."),
) + A2A_HINTS


def _reference(seed, n, capacity_factor, skew):
    """The dense layer on every rank's tokens, forward and backward, with the capacity rule applied per rank."""
    A, s = answers("lab07"), shape(seed, n)
    parts = [inputs(seed, n, r, skew) for r in range(n)]
    _, router, w1, w2, _ = parts[0]
    keeps = None
    if capacity_factor is not None:
        cap = ep.capacity(s["tokens"], s["k"], capacity_factor, s["experts"])
        keeps = []
        for p in parts:
            gates, experts, _ = A.route(p[0], router, s["k"])
            keeps.append(A.keep_mask(experts, gates, s["experts"], cap))
    leaves = [t.clone().requires_grad_() for t in (torch.cat([p[0] for p in parts]), router, w1, w2)]
    want = A.moe_dense(*leaves, s["k"], None if keeps is None else torch.cat(keeps))
    want.backward(torch.cat([p[4] for p in parts]))
    return want.detach(), [t.grad for t in leaves], keeps, leaves


def judge_ranks(task, data, n, seed, capacity_factor=None, skew=0.0) -> float:
    A, s = answers("lab07"), shape(seed, n)
    want, grads, keeps, (x, router, w1, w2) = _reference(seed, n, capacity_factor, skew)
    T, E, k, local = s["tokens"], s["experts"], s["k"], s["experts"] // n
    sent = torch.zeros(n, E, dtype=torch.long)                             # assignments sent: rank -> expert
    for r in range(n):
        experts = A.route(x[r * T:(r + 1) * T].detach(), router.detach(), k)[1]
        kept = experts if keeps is None else experts[keeps[r]]
        sent[r] = torch.bincount(kept.flatten(), minlength=E)
    to_rank = sent.view(n, n, local).sum(2)                                # to_rank[src][dst], tokens
    worst, router_grad = 0.0, 0
    for r, res in enumerate(data):
        mine = slice(r * T, (r + 1) * T)
        where = f"{task}: rank {r}"
        if isinstance(res["y"], torch.Tensor) and res["y"].shape != (T, x.shape[1]):
            raise CheckFailed(f"{where}: the layer returned shape {tuple(res['y'].shape)}; expected ({T}, {x.shape[1]}): "
                              "one row per token of this rank, every token, a dropped one as itself (x + nothing).")
        err = max_error(res["y"], want[mine], f"{where}: the output")
        if err > TOL:
            name_output_mistake(task, res["y"], x.detach()[mine], router.detach(), w1.detach(), w2.detach(), k,
                                None if keeps is None else keeps[r], capacity_factor, n)
            if keeps is not None:
                lost = ~keeps[r].any(1)
                if lost.any() and res["y"][lost].abs().max() < TOL:
                    raise CheckFailed(f"{where}: tokens whose every assignment was dropped came out as zeros; they pass "
                                      "through: their output is x.")
            raise CheckFailed(f"{where}: the output differs from the dense layer by {err:.2e}. Go through the steps: the "
                              "counts that arrive give the receive splits; what arrives is rank-major, each expert "
                              "takes its rows from every rank; the results go back in the order they came; "
                              "`y[order] = returned` undoes the sort; each result weighted by its gate once; plus x.")
        if any(gr is None for gr in res["grads"]):
            raise CheckFailed(f"{where}: no gradient reached {['x', 'router', 'w1', 'w2'][res['grads'].index(None)]}: "
                              "the tokens must travel through your autograd_all_to_all (Task 7.2), both ways, for autograd to "
                              "carry the gradients back.")
        gx, gr, g1, g2 = res["grads"]
        for name, got, ref in (("x", gx, grads[0][mine]), ("w1", g1, ep.local(grads[2], r, n)),
                               ("w2", g2, ep.local(grads[3], r, n))):
            e = max_error(got, ref, f"{where}: the gradient of {name}")
            if e > TOL:
                raise CheckFailed(f"{where}: the gradient of {name} differs from the dense layer's by {e:.2e}. " + (
                    "A token's gradient comes back through the dispatch: send the tokens with your autograd_all_to_all, "
                    "whose backward returns them (a plain lablib.all_to_all cuts the graph)." if name == "x" else
                    "An expert's gradient comes from the tokens of every rank: the results must go home through your "
                    "autograd_all_to_all, whose backward brings their gradients to the expert."))
            worst = max(worst, e, err)
        router_grad = router_grad + gr.double()
        _traffic(where, res, r, n, E, to_rank, x.shape[1] * 4)
        want_rows = [c for c in sent[:, r * local:(r + 1) * local].sum(0).tolist() if c]
        if [c for c in res["rows"] if c] != want_rows:
            raise CheckFailed(f"{where} ran lablib.expert on {res['rows']} tokens; its {local} expert(s) got "
                              f"{want_rows} assignments from all ranks: regroup what arrived (rank-major) into one "
                              "batch per expert, and call lablib.expert once per expert.")
    if max_error(router_grad.float(), grads[1], f"{task}: the router's gradient") > 1e-4:
        raise CheckFailed(f"{task}: the router's gradient, summed over the ranks, differs from the dense layer's: the "
                          "gates must come from your route() on this rank's tokens and weight the returned outputs.")
    return worst


def _traffic(where, res, r, n, E, to_rank, row):
    """The counts went first, then the tokens: to each rank what the routing sends it, and back."""
    ops = res["ops"]
    other = sorted({o.split()[0] for o in ops} - {"all_to_all"})
    if other:
        raise CheckFailed(f"{where} called {', '.join(other)}: the layer moves tokens with lablib.all_to_all only.")
    small = [int(o.split()[1]) <= 8 * E for o in ops]
    if not small or not small[0]:
        raise CheckFailed(f"{where}'s first all-to-all sent {ops[0].split()[1] if ops else 0} bytes: the counts go "
                          f"first (how many tokens for each expert: {E} numbers), so each rank knows what it will receive.")
    want = [[c * row for c in to_rank[r].tolist()], [c * row for c in to_rank[:, r].tolist()]] * 2
    got = [bytes_to(o) for o in ops[-4:]] if len(ops) >= 5 and all(small[1:-4]) else [bytes_to(o) for o in ops[1:]]
    if got != want:
        raise CheckFailed(f"{where}: after the counts, its all-to-alls sent {got} bytes to each rank; the routing sends "
                          f"{want[0]} in the dispatch and returns {want[1]} in the combine (then the same, the other way, "
                          "in the backward): each token goes only to its experts' ranks, once per kept assignment.")
