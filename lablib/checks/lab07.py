"""Lab 07 (expert parallelism): Task 7.1 (the top-k router and the dense mixture, one process), 7.2 (an
all-to-all autograd goes through), 7.3 (the capacity rule), 7.4 (the expert-parallel layer: counts, tokens,
experts, back, with and without a capacity) and 7.5 (the load-balancing loss), judged against the dense
single-process layer (outputs and gradients) and from what each rank sent: the counts first, then each
token to its experts' ranks only, the bytes to each rank what the routing says."""
from __future__ import annotations

import random

import torch

from ..strategies import experts as ep
from ..toy import generator
from . import Check, CheckFailed, answers, call_local, max_error, run_on_ranks, whose
from .lab07_layer import (A2A_HINTS, FORBIDDEN, LAYER_HINTS, TOL, bytes_to, inputs, judge_ranks, layer_job,
                          layer_shares, name_output_mistake, shape)


# -- Task 7.1: the router and the dense mixture, in one process -------------------------------------------
def collect_dense(fns, pool, seed):
    route, dense = fns
    x, router, w1, w2, g = inputs(seed, 4, 0, skew=1.0)
    k = shape(seed, 4)["k"]
    out = {"route": call_local("Task 7.1", route, f"x, router, k={k}", "It returns (gates, experts, probs).",
                               x, router, k)}
    leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    y = call_local("Task 7.1", dense, f"x, router, w1, w2, k={k}", "It returns the layer's output (tokens, dim).",
                   *leaves, k)
    if isinstance(y, torch.Tensor) and y.requires_grad:
        (y * g).sum().backward()
    out["dense"] = [y.detach() if isinstance(y, torch.Tensor) else y, [t.grad for t in leaves]]
    return out


def judge_dense(data, world_size, seed) -> str:
    A, task = answers("lab07"), "Task 7.1"
    x, router, w1, w2, g = inputs(seed, 4, 0, skew=1.0)
    k = shape(seed, 4)["k"]
    gates, experts, probs = A.route(x, router, k)
    got = data["route"]
    if not isinstance(got, (list, tuple)) or len(got) != 3:
        raise CheckFailed(f"{task}: route returned {type(got).__name__}; expected (gates, experts, probs).")
    if max_error(got[2], probs, f"{task}: route's probs") > TOL:
        raise CheckFailed(f"{task}: route's probs differ from softmax(x @ router) over the experts (dim -1): each "
                          "token's probabilities add up to 1.")
    max_error(got[1], experts.float(), f"{task}: route's experts")
    if not torch.equal(got[1].long(), experts):
        raise CheckFailed(f"{task}: route's experts are not each token's k most probable, highest first "
                          "(torch.topk of the probabilities).")
    if max_error(got[0], gates, f"{task}: route's gates") > TOL:
        renormalised = (got[0] - gates / gates.sum(-1, keepdim=True)).abs().max() < TOL
        raise CheckFailed(f"{task}: route's gates differ from the top-k probabilities." + (
            " They add up to 1 per token: the gates here are the probabilities as they are, not renormalised over "
            "the k chosen." if renormalised and k > 1 else ""))
    y, grads = data["dense"]
    leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    want = A.moe_dense(*leaves, k)
    want.backward(g)
    err = max_error(y, want.detach(), f"{task}: moe_dense's output")
    if err > TOL:
        name_output_mistake(task, y, x, router, w1, w2, k)
        raise CheckFailed(f"{task}: moe_dense's output differs from the layer by {err:.2e}: each token's output is "
                          "x + Σ over its k experts of gate · lablib.expert(x, w1[e], w2[e]).")
    for name, got_g, leaf in zip(("x", "router", "w1", "w2"), grads, leaves):
        if got_g is None or max_error(got_g, leaf.grad, f"{task}: the gradient of {name}") > TOL:
            raise CheckFailed(f"{task}: moe_dense's gradient for {name} is {'missing' if got_g is None else 'wrong'}: "
                              "build the output from x, the gates and the experts with torch operations autograd "
                              "follows (index_add, not an in-place write into a tensor made with torch.no_grad).")
    return f": top-{k} routing and the dense layer of {w1.shape[0]} experts, forward and backward"


check_dense = Check("Task 7.1", ("route", "moe_dense"), collect_dense, judge_dense, world_sizes=(), forbidden=FORBIDDEN)
"""Task 7.1: top-k routing and the dense reference."""


# -- Task 7.2: an all-to-all autograd goes through --------------------------------------------------------
def splits_matrix(seed, n: int) -> list[list[int]]:
    """rows[src][dst] a check's all-to-all sends, uneven, some zero."""
    rng = random.Random(1 + (seed or 0) * 31 + n)
    return [[rng.choice((0, 1, 2, 3, 5)) for _ in range(n)] for _ in range(n)]


def a2a_job(fn, seed) -> dict:
    import torch.distributed as dist

    from ..comm import to_device, watched

    r, n = dist.get_rank(), dist.get_world_size()
    rows = splits_matrix(seed, n)
    ins, outs = rows[r], [rows[j][r] for j in range(n)]
    x = to_device(torch.arange(sum(ins) * 3, dtype=torch.float32).view(-1, 3) + 1000 * r).requires_grad_()
    g = to_device(torch.arange(sum(outs) * 3, dtype=torch.float32).view(-1, 3) * -1 - 1000 * r)

    def step():
        y = fn(x, outs, ins)
        (y * g).sum().backward()
        return y.detach()

    y, ops = watched(step, peers=True)
    return {"y": y, "grad": x.grad, "ops": ops}


def collect_a2a(fns, pool, seed):
    return run_on_ranks(pool, "Task 7.2", a2a_job, fns[0], seed, hints=A2A_HINTS)


def judge_a2a(data, world_size, seed) -> str:
    n, rows = world_size, splits_matrix(seed, world_size)
    x = [torch.arange(sum(rows[r]) * 3, dtype=torch.float32).view(-1, 3) + 1000 * r for r in range(n)]
    g = [torch.arange(sum(rows[j][r] for j in range(n)) * 3, dtype=torch.float32).view(-1, 3) * -1 - 1000 * r
         for r in range(n)]
    starts = [[sum(rows[r][:j]) for j in range(n)] for r in range(n)]
    got_starts = [[sum(rows[j][r] for j in range(i)) for i in range(n)] for r in range(n)]
    for r, res in enumerate(data):
        want = torch.cat([x[j][starts[j][r]:starts[j][r] + rows[j][r]] for j in range(n)])
        if max_error(res["y"], want, f"Task 7.2: rank {r}'s output") > 0:
            raise CheckFailed(f"Task 7.2: rank {r}'s output is not the rows every rank sent it, in rank order: rank j's "
                              "rows for it arrive at output rows sum(output_splits[:j]) onward.")
        grad = torch.cat([g[j][got_starts[j][r]:got_starts[j][r] + rows[r][j]] for j in range(n)])
        if res["grad"] is None or max_error(res["grad"], grad, f"Task 7.2: rank {r}'s input gradient") > 0:
            raise CheckFailed(f"Task 7.2: rank {r}'s input gradient is not the gradient of the rows it sent, come back "
                              "from where they went: the backward is the all-to-all with the splits swapped.")
        sent = [bytes_to(o) for o in res["ops"]]
        want_ops = [[c * 12 for c in rows[r]], [rows[j][r] * 12 for j in range(n)]]
        if sent != want_ops:
            raise CheckFailed(f"Task 7.2: rank {r}'s traced calls sent {res['ops']}; expected one lablib.all_to_all in "
                              f"the forward (bytes to each rank {want_ops[0]}) and one in the backward ({want_ops[1]}).")
    return f" on {n} ranks: uneven splits, zeros among them, forward and backward"


check_a2a = Check("Task 7.2", ("autograd_all_to_all",), collect_a2a, judge_a2a, world_sizes=(2, 4), forbidden=FORBIDDEN,
                  every_size=True)
"""Task 7.2: an all-to-all with split sizes that autograd goes through."""


# -- Task 7.3: the capacity rule, on one rank ---------------------------------------------------------------
_SKEW = 3.0  # with a capacity, the tokens are pulled toward expert 0: its capacity overflows
_FACTORS = (None, 1.0, 1.25)


def _routing(seed, tokens: int, experts: int, k: int, skew: float) -> tuple:
    """(probs, experts, gates) of a made-up router: each token's k distinct experts drawn from its
    probabilities, which ``skew`` tilts toward expert 0; gates those experts' probabilities."""
    g = generator(17 + (seed or 0) * 7 + experts * 3 + k)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += skew
    probs = torch.softmax(logits, -1)
    chosen = torch.multinomial(probs, k, generator=g)
    return probs, chosen, probs.gather(1, chosen)


def _keep_cases(seed=None) -> dict:
    e = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0]])
    g = torch.tensor([[.5, .2], [.5, .3], [.6, .3], [.4, .1], [.7, .2]])
    cases = {"a tie at the capacity": (e, g, 3, 2), "capacity 0": (e, g, 3, 0), "room for all": (e, g, 3, 5),
             "top-1": (e[:, :1], g[:, :1], 3, 1)}
    for n in (2, 4):
        s = shape(seed, n)
        _, experts, gates = _routing(seed, s["tokens"], s["experts"], s["k"], _SKEW)
        cap = ep.capacity(s["tokens"], s["k"], 1.0, s["experts"])
        cases[f"{s['tokens']} tokens, most to expert 0, {s['experts']} experts, top-{s['k']}"] = (
            experts, gates, s["experts"], cap)
    return cases


def _by_position(experts, E: int, cap: int) -> list:
    """The masks that keep each expert's first ``cap`` assignments by position: token by token, and (as
    GShard) every token's first choice before any second choice."""
    t, k = experts.shape
    token_major = torch.arange(t * k)
    slot_major = torch.arange(t * k).view(t, k).t().flatten()
    masks = []
    for order in (token_major, slot_major):
        keep = torch.zeros(t * k, dtype=torch.bool)
        flat = experts.flatten()[order]
        for e in range(E):
            keep[order[flat == e][:cap]] = True
        masks.append(keep.view(t, k))
    return masks


def collect_keep(fns, pool, seed):
    return {name: call_local("Task 7.3", fns[0], f"experts, gates, {E}, capacity={cap} ({name})",
                             "It returns a (tokens, k) mask of booleans.", experts, gates, E, cap)
            for name, (experts, gates, E, cap) in _keep_cases(seed).items()}


def judge_keep(data, world_size, seed) -> str:
    A = answers("lab07")
    for name, (experts, gates, E, cap) in _keep_cases(seed).items():
        got, want = data[name], A.keep_mask(experts, gates, E, cap)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != want.shape:
            raise CheckFailed(f"Task 7.3 ({name}): expected a ({', '.join(map(str, want.shape))}) tensor of booleans, "
                              f"got {got.dtype if isinstance(got, torch.Tensor) else type(got).__name__}"
                              f"{tuple(got.shape) if isinstance(got, torch.Tensor) else ''}.")
        if not torch.equal(got, want):
            small = experts.numel() <= 10
            over = [e for e in range(E) if int((got & (experts == e)).sum()) > cap]
            if not over and any(torch.equal(got, m) for m in _by_position(experts, E, cap)):
                raise CheckFailed(f"Task 7.3 ({name}): each expert kept its first {cap} assignments by position (first "
                                  "come, first served: Switch Transformer's and GShard's rule, Megatron-Core's "
                                  "moe_token_drop_policy=\"position\"). This task keeps each expert's highest gates "
                                  "instead (Megatron-Core's \"probs\"): order the assignments by gate, highest first (a "
                                  "stable sort keeps the earlier token first on a tie), then keep the first "
                                  f"{cap} of each expert.")
            raise CheckFailed(f"Task 7.3 ({name}): " + (f"experts {experts.tolist()}, gates {[[round(g, 3) for g in row] for row in gates.tolist()]}, " if small
                                                        else "") + f"capacity {cap}: " + (
                f"expert {over[0]} keeps more than {cap}." if over else
                f"expected the mask {want.int().tolist()}, got {got.int().tolist()}." if small else
                f"the mask differs in {int((got != want).sum())} places.") + " Each expert keeps its highest-gate "
                "assignments (on a tie, the earlier token), at most capacity of them, counted over every slot of "
                "every token.")
    return ": each expert keeps its highest gates up to the capacity, ties to the earlier token"


check_keep = Check("Task 7.3", ("keep_mask",), collect_keep, judge_keep, world_sizes=(), forbidden=FORBIDDEN)
"""Task 7.3: the capacity rule, on one rank."""


# -- Task 7.4: the layer, its experts on the ranks -------------------------------------------------
def collect_layer(fns, pool, seed):
    n, out = pool.world_size, {}
    for cf in _FACTORS:
        share = layer_shares(seed, n, 0.0 if cf is None else _SKEW)
        out[str(cf)] = run_on_ranks(pool, "Task 7.4", layer_job, fns[0], share, shape(seed, n)["k"], cf,
                                    hints=LAYER_HINTS)
    return out


def judge_layer(data, world_size, seed) -> str:
    worst = 0.0
    for cf in _FACTORS:
        task = "Task 7.4" + ("" if cf is None else f" (capacity factor {cf}, tokens pulled toward expert 0)")
        worst = max(worst, judge_ranks(task, data[str(cf)], world_size, seed, cf, 0.0 if cf is None else _SKEW))
    s = shape(seed, world_size)
    return (f" on {world_size} ranks, {s['experts']} experts, top-{s['k']}: equal to the dense layer forward and "
            f"backward (max error {worst:.1e}), without a capacity and at factors 1.0 and 1.25; counts first, each "
            "token to its experts' ranks only, the dropped ones not sent")


check_layer = Check("Task 7.4", ("moe_layer",), collect_layer, judge_layer, world_sizes=(2, 4), forbidden=FORBIDDEN,
                    every_size=True, after=("Task 7.1", "Task 7.2", "Task 7.3"))
"""Task 7.4: the expert-parallel layer, with and without a capacity."""


# -- Task 7.5: the load-balancing loss ------------------------------------------------------------------------
def _loss_cases(seed=None) -> dict:
    """The first has as many tokens as experts: there probs.mean(1) has the shape of probs.mean(0)."""
    return {name: (*_routing(seed, tokens, E, k, skew)[:2], E, 0.01)
            for name, tokens, skew, E, k in (("skewed, top-2, 8 tokens, 8 experts", 8, 3.0, 8, 2),
                                            ("skewed, top-2", 32, 3.0, 8, 2), ("even, top-1", 40, 0.0, 4, 1),
                                            ("skewed, top-1", 24, 2.0, 6, 1))}


_MEAN_OVER_EXPERTS = ("Pᵢ was averaged over the experts (probs.mean(1), or dim=-1): each token's probabilities add up "
                      "to 1, so that mean is 1/E for every token, and the loss is α whatever the routing. Pᵢ is expert "
                      "i's mean probability over the tokens: probs.mean(0), probs being (tokens, E)")


def _is_alpha(loss, alpha) -> bool:
    return isinstance(loss, torch.Tensor) and loss.numel() == 1 and abs(loss.item() - alpha) < 1e-6 * alpha


def collect_loss(fns, pool, seed):
    out = {}
    for name, (probs, experts, E, alpha) in _loss_cases(seed).items():
        p = probs.clone().requires_grad_()
        try:
            loss = call_local("Task 7.5", fns[0], f"probs, experts, {E}, {alpha} ({name})",
                              "It returns a scalar tensor.", p, experts, E, alpha)
        except CheckFailed as err:
            square = next(iter(out.values()), [None])[0]
            if _is_alpha(square, alpha) and probs.shape[0] != E:
                raise CheckFailed(f"Task 7.5 ({name}): {_MEAN_OVER_EXPERTS}.\n\n{err}") from None
            raise
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
            loss.backward()
        out[name] = [loss.detach() if isinstance(loss, torch.Tensor) else loss, p.grad]
    return out


def judge_loss(data, world_size, seed) -> str:
    A = answers("lab07")
    for name, (probs, experts, E, alpha) in _loss_cases(seed).items():
        p = probs.clone().requires_grad_()
        want = A.load_balance_loss(p, experts, E, alpha)
        want.backward()
        got, grad = data[name]
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            raise CheckFailed(f"Task 7.5 ({name}): expected a scalar tensor, got {got!r}.")
        ratio = (got.double() / want.detach().double()).item()
        if abs(ratio - 1) > 1e-5 and probs.shape[0] == E and _is_alpha(got, alpha):
            raise CheckFailed(f"Task 7.5 ({name}): the loss is {got.item():.6g}, expected {want.item():.6g}: "
                              f"{_MEAN_OVER_EXPERTS}.")
        if abs(ratio - 1) > 1e-5:
            k = experts.shape[1]
            hint = next((h for r, h in ((k, f"fᵢ counts each of a token's {k} assignments: divide by tokens × k, so "
                                            "the fractions add up to 1"), (1 / E, "the loss is multiplied by E, the number "
                                            "of experts, so an even load gives α"), (E, "E appears once: α·E·Σ fᵢ·Pᵢ"))
                         if r != 1 and abs(ratio - r) < 1e-4), "fᵢ: the fraction of assignments routed to expert i (a "
                        "count); Pᵢ: the mean router probability of expert i over the tokens")
            raise CheckFailed(f"Task 7.5 ({name}): the loss is {got.item():.6g}, expected {want.item():.6g}: {hint}.")
        if grad is None or max_error(grad, p.grad, f"Task 7.5 ({name}): the gradient") > 1e-6:
            raise CheckFailed(f"Task 7.5 ({name}): the loss is right but its gradient is not: only Pᵢ (the mean of the "
                              "probabilities) carries one; fᵢ is a count of the routing, which has none.")
    return ": α·E·Σ fᵢ·Pᵢ and its gradient, on even and skewed routing, top-1 and top-2"


check_loss = Check("Task 7.5", ("load_balance_loss",), collect_loss, judge_loss, world_sizes=(), forbidden=FORBIDDEN)
"""Task 7.5: the load-balancing loss."""


# -- the notebook's measurements run the learner's functions once they have passed --------------------------
_TASKS = {"route": "Task 7.1", "moe_dense": "Task 7.1", "moe_layer": "Task 7.4", "load_balance_loss": "Task 7.5"}


def yours(**fns) -> dict:
    """{name: function} for the notebook's measurements: the learner's whose check passed in this kernel,
    lablib's for the others (printed)."""
    mine = whose(fns, {name: task for name, task in _TASKS.items() if name in fns})
    lablibs = answers("lab07")
    return {name: fns[name] if name in mine else getattr(lablibs, name) for name in _TASKS}
