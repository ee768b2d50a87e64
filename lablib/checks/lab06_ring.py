"""Lab 06's inputs (a seed's q, k, v and output gradient) and Tasks 6.2-6.3's rank job and judgement: the
learner's ring attention (and its backward) run on each rank's chunk, contiguous and zig-zag, causal and not,
with every message it sent and every handle it left unwaited, judged against single-process SDPA and its
autograd (``checks.lab06`` holds the checks)."""
from __future__ import annotations

import random

import torch

from ..pool import PerRank
from ..strategies import context_parallel as cp
from ..toy import generator
from . import CheckFailed, max_error
from . import lab06_mistakes as mistakes

TOL = 1e-4  # fp32: the order in which the blocks are summed moves the last bits


def shape(seed) -> tuple:
    """(B, H, T, D): T divides into 2P chunks and H into P heads at P = 2, 3 and 4."""
    if seed is None:
        return (2, 12, 48, 8)  # a batch of 2: a layout that mixes up batch and ranks shows
    rng = random.Random(seed)
    return (2, 12, 24 * rng.randint(1, 3), rng.choice((4, 8)))


def inputs(seed):
    return cp.qkv(*shape(seed), seed=seed or 0)


def grad_out(seed):
    return torch.randn(shape(seed), generator=generator(11 + (seed or 0)))


def pair(task, what, got):
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        raise CheckFailed(f"{task}: {what} returned {type(got).__name__}, expected a pair (out, lse).")
    return got


LAYOUTS = ("contiguous", "zigzag")


def shares(seed, n: int, backward: bool) -> PerRank:
    """Each rank's share of a check's inputs, per layout: its rows of q, k and v and, for the backward, of the
    output, its log-sum-exp (per mask) and the output's gradient; made here from the seed, so that no rank gets
    the seed or another rank's rows."""
    q, k, v = inputs(seed)
    T = q.shape[-2]
    refs = {c: (cp.reference(q, k, v, c), cp.reference_lse(q, k, c)) for c in (False, True)} if backward else {}
    dout = grad_out(seed) if backward else None
    per = []
    for r in range(n):
        mine = {"T": T}
        for layout in LAYOUTS:
            rows = cp.positions(layout, r, n, T)
            share = {"qkv": [t[..., rows, :].contiguous() for t in (q, k, v)]}
            if backward:
                share["dout"] = dout[..., rows, :].contiguous()
                for causal, (o, lse) in refs.items():
                    share[causal] = (o[..., rows, :].contiguous(), lse[..., rows].contiguous())
            mine[layout] = share
        per.append(mine)
    return PerRank(per)


def ring_job(fns, backward: bool, share: dict) -> dict:
    """On each rank, per layout and mask: the learner's ring attention (and its backward) on this rank's
    chunk (``share``), with the messages it sent and received (lablib's traced calls, with their peers)."""
    import torch.distributed as dist

    from ..comm import to_device, watched

    r, n = dist.get_rank(), dist.get_world_size()
    T = share["T"]
    out = {}
    for layout in LAYOUTS:
        every = [to_device(cp.positions(layout, s, n, T)) for s in range(n)]
        mine = [to_device(t) for t in share[layout]["qkv"]]
        for causal in (False, True):
            flight = blocks = None
            works: list = []
            if not backward:
                cp._IN_FLIGHT[0] = []
                try:
                    (got, ops), blocks = cp.blocks_of(watched, fns[0], *mine, every, causal, works=works, peers=True)
                finally:
                    flight, cp._IN_FLIGHT[0] = cp._IN_FLIGHT[0], None
            else:
                o, lse = (to_device(t) for t in share[layout][causal])
                got, ops = watched(fns[0], *mine, every, o, lse, to_device(share[layout]["dout"]), causal, works=works,
                                   peers=True)
            unwaited = [w.op for w in works if not w.waited]
            _drain(works)
            out[f"{layout}/{causal}"] = {"got": list(got) if isinstance(got, (tuple, list)) else got, "ops": ops,
                                         "rows": every[r], "in_flight": flight, "blocks": blocks, "unwaited": unwaited}
    return out


def _drain(works):
    """Wait for the handles the learner's function left unwaited (the judge names them), so that no message
    of this run is still in flight when the next one starts; one that never completes is left to the pool's
    timeout."""
    from datetime import timedelta

    for w in works:
        if not w.waited:
            try:
                w.wait(timedelta(seconds=5))
            except RuntimeError:
                pass


def _positions(layout, n, T):
    return [cp.positions(layout, s, n, T) for s in range(n)]


def _messages(task, rank, n, ops, hops: int, chunk_bytes: int, what: str, least: int | None = None):
    wrong = [o for o in ops if o.split()[0] not in ("send", "recv")]
    if wrong:
        raise CheckFailed(f"{task}: rank {rank} called {', '.join(sorted(set(o.split()[0] for o in wrong)))}: in a ring "
                          f"the {what} travel between neighbours only, with lablib.isend/irecv.")
    sends = [o.split() for o in ops if o.startswith("send")]
    peers = {int(o[-1]) for o in sends}
    if peers - {(rank + 1) % n}:
        raise CheckFailed(f"{task}: rank {rank} sent to rank(s) {sorted(peers)}: each rank sends only to the next, "
                          f"(rank + 1) % world_size, and receives only from the one before.")
    sent = sum(int(o[1]) for o in sends)
    if not (least if least is not None else hops * chunk_bytes) <= sent <= hops * chunk_bytes:
        raise CheckFailed(f"{task}: rank {rank} sent {sent} bytes; the ring passes the {what} ({chunk_bytes} bytes a "
                          f"hop) {hops} times: {hops * chunk_bytes} bytes.")


def judge_ring(task, data, n, seed, backward: bool) -> float:
    q, k, v = (t.requires_grad_(backward) for t in inputs(seed))
    if not isinstance(data, list) or len(data) != n:
        raise CheckFailed(f"{task}: expected one result per rank from {n} ranks.")
    B, H, T, D = shape(seed)
    chunk = B * H * (T // n) * D * 4
    worst = 0.0
    for causal in (False, True):
        want = cp.reference(q, k, v, causal)
        if backward:
            want.backward(grad_out(seed))
            grads = [t.grad.detach().clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
        lse = cp.reference_lse(q.detach(), k.detach(), causal)
        for layout in LAYOUTS:
            for rank, per in enumerate(data):
                res = per[f"{layout}/{causal}"]
                rows, where = res["rows"], f"{layout} layout, causal={causal}, rank {rank}"
                never = mistakes.never_waited(task, f"{layout} layout, causal={causal}", rank, res.get("unwaited"))
                if never:
                    raise CheckFailed(never)
                got = pair(task, "your function", res["got"]) if not backward else res["got"]
                if backward:
                    if not isinstance(got, list) or len(got) != 3:
                        raise CheckFailed(f"{task}: ring_attention_backward returned {type(got).__name__}; expected "
                                          "(dq, dk, dv).")
                    errs = {name: max_error(g, w[..., rows, :], f"{task}: {where}: {name}")
                            for name, g, w in zip(("dq", "dk", "dv"), got, grads)}
                    bad = [name for name, err in errs.items() if err > TOL]
                    if bad:
                        name = bad[0]
                        hint = {"dq": "dq sums over every block: ds @ k, scaled by 1/sqrt(d), with ds = p * (dp - "
                                      "rowsum(dout * out)) and p = exp(scores - lse).",
                                "dk": "dk += ds^T @ q at each block, scaled by 1/sqrt(d), on the chunk's own dk.",
                                "dv": "dv += p^T @ dout at each block, on the chunk's own dv."}[name]
                        if "dk" in bad and "dv" in bad:
                            hint = ("dk and dv belong to the chunk's home rank: they travel round the ring with their "
                                    "K/V chunk, each rank adding its queries' part, and arrive home after world_size hops.")
                        if causal:
                            hint += (" Without the mask this was right: mask the scores where a key comes after its "
                                     "query, as the forward does, before p = exp(scores - lse).")
                        per_block = mistakes.per_block_softmax(task, where, got, mistakes.per_block_grads(
                            q.detach(), k.detach(), v.detach(), grad_out(seed), _positions(layout, n, T), causal), rows)
                        if per_block:
                            raise CheckFailed(per_block)
                        raise CheckFailed(f"{task}: {where}: {name} differs from SDPA's gradient by {errs[name]:.2e}. {hint}")
                    worst = max([worst, *errs.values()])
                    _messages(task, rank, n, res["ops"], n, 4 * chunk, "K, V, dK and dV", least=(2 * n - 1) * 2 * chunk)
                else:
                    out, got_lse = got
                    err = max_error(out, want.detach()[..., rows, :], f"{task}: {where}: out")
                    early = mistakes.read_before_waited(task, where.rsplit(",", 1)[0], rank, res["in_flight"],
                                                       len(res["blocks"] or ()) == n)
                    if early and (err > TOL or out.isnan().any()):
                        raise CheckFailed(early)
                    if out.isnan().any():
                        raise CheckFailed(f"{task}: {where}: your output has NaN: a row that saw no key in a block "
                                          "(lse -inf on both sides of a merge) must stay zeros.")
                    if err > TOL:
                        raise CheckFailed(f"{task}: {where}: the output differs from SDPA on the whole sequence by "
                                          f"{err:.2e}. Attend to the chunk held at each step with its home rank's "
                                          "positions (positions[src], src = (rank - step) % world_size), merging as in "
                                          "Task 6.1; receive the next chunk into a fresh buffer, as the one you hold is "
                                          "still being sent.")
                    if max_error(got_lse, lse[..., rows], f"{task}: {where}: lse") > TOL:
                        raise CheckFailed(f"{task}: {where}: the lse differs from the whole sequence's.")
                    worst = max(worst, err)
                    _messages(task, rank, n, res["ops"], n - 1, 2 * chunk, "K and V")
    return worst


def posted_first(task, data, n):
    """Each rank attended to every chunk with lablib.attend (not to everything at once, by other means), and
    computed its first block with the next chunk's receive already posted."""
    for rank, per in enumerate(data):
        blocks = [tuple(b) for b in per["contiguous/False"]["blocks"] or ()]
        size = len(per["contiguous/False"]["rows"])
        if blocks != [(size, size)] * n:
            raise CheckFailed(f"{task}: without a mask, rank {rank} called lablib.attend on blocks (queries, keys) "
                              f"{blocks[:6]}; a ring attends its {size} queries to each of the {n} chunks it holds, "
                              f"one call per chunk: {[(size, size)] * n}.")
        flight = per["contiguous/False"]["in_flight"]
        if n > 1 and flight and not flight[0]:
            raise CheckFailed(f"{task}: rank {rank} computed its first block with no receive posted: the recv of the "
                              "next chunk came after the compute that could have hidden it. Post the next chunk's "
                              "lablib.isend and lablib.irecv first, attend to the chunk you hold, then wait.")
