"""Lab 06 (context parallelism): Task 6.1 (the online-softmax merge and blockwise attention, one process),
6.2 (ring attention forward), 6.3 (its backward), 6.4 (the zig-zag shard) and 6.5 (all-to-all attention),
each against single-process SDPA (and its autograd) in fp32, judged from what each rank computed and sent:
a ring passes K/V chunks to its neighbour, one hop a step, and gathers nothing."""
from __future__ import annotations

import random

import torch

from ..strategies import context_parallel as cp
from . import Check, CheckFailed, answers, call_local, max_error, run_on_ranks, whose
from .policy import COLLECTIVES

TOL = 1e-4  # fp32: the order in which the blocks are summed moves the last bits
_OWN = {"scaled_dot_product_attention": "the lab builds attention from lablib.attend; SDPA is the reference it is "
                                        "checked against",
        "~context_parallel": "PyTorch's context parallelism is what the lab compares with; build it yourself"}
_NO_LIBRARY = {**COLLECTIVES, **_OWN}


def shape(seed) -> tuple:
    """(B, H, T, D): T divides into 2P chunks and H into P heads at P = 2, 3 and 4."""
    if seed is None:
        return (2, 12, 48, 8)  # a batch of 2: a layout that mixes up batch and ranks shows
    rng = random.Random(seed)
    return (2, 12, 24 * rng.randint(1, 3), rng.choice((4, 8)))


def _inputs(seed):
    return cp.qkv(*shape(seed), seed=seed or 0)


def _grad_out(seed):
    return torch.randn(shape(seed), generator=torch.Generator().manual_seed(11 + (seed or 0)))


# -- Task 6.1: the merge and blockwise attention, in one process ------------------------------------------
def _halves(q, k, v):
    """Causal attention of every query to the first and to the second half of the keys: the early queries
    see nothing of the second half (lse -inf), as a merge must survive."""
    T = q.shape[-2]
    pos, h = torch.arange(T), T // 2
    return (cp.attend(q, k[..., :h, :], v[..., :h, :], pos, pos[:h], True),
            cp.attend(q, k[..., h:, :], v[..., h:, :], pos, pos[h:], True))


def collect_blockwise(fns, pool, seed):
    merge, blockwise = fns
    q, k, v = _inputs(seed)
    out = {}
    # the merge on its own: two partial results of the same rows, some of which saw no key on either side
    a, b = _halves(q, k, v)
    none = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    for name, (x, y) in {"two blocks": (a, b), "nothing and a block": (none, b), "nothing twice": (none, none)}.items():
        out[name] = call_local("Task 6.1", merge, f"out, lse, block_out, block_lse ({name})",
                               "It returns (out, lse) for the merged rows; lse is (B, H, T), one number per row: to "
                               "weight out (B, H, T, D) by it, add a last dimension, exp(...)[..., None].",
                               x[0], x[1], y[0], y[1])
    for causal in (False, True):
        for block in (q.shape[-2], 16, 5):
            (got, blocks) = cp.blocks_of(call_local, "Task 6.1", blockwise, f"q, k, v, block={block}, causal={causal}",
                                         "It returns (out, lse).", q, k, v, block, causal)
            out[f"{block}/{causal}"] = [got, blocks]
    return out


def _pair(task, what, got):
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        raise CheckFailed(f"{task}: {what} returned {type(got).__name__}, expected a pair (out, lse).")
    return got


def judge_blockwise(data, world_size, seed) -> str:
    task = "Task 6.1"
    q, k, v = _inputs(seed)
    T = q.shape[-2]
    a, b = _halves(q, k, v)
    whole = cp.attend(q, k, v, torch.arange(T), torch.arange(T), True)
    out, lse = _pair(task, "merge (two blocks)", data["two blocks"])
    if isinstance(out, torch.Tensor) and out.shape != whole[0].shape:
        raise CheckFailed(f"{task}: merge's out has shape {tuple(out.shape)}, expected {tuple(whole[0].shape)}: lse has "
                          "one number per row, (B, H, T); to weight out (B, H, T, D) by it, add a last dimension, "
                          "exp(...)[..., None].")
    if max_error(out, whole[0], f"{task}: merge's out") > TOL:
        summed = (a[0] + b[0] - out).abs().max() < TOL
        raise CheckFailed(f"{task}: merging two blocks of keys differs from attending to both at once." + (
            " It looks like out + block_out: each partial output is normalised over its own keys, so rescale each "
            "by exp(its lse - the merged lse) before adding." if summed else
            " The merged lse is log(exp(lse) + exp(block_lse)) (torch.logaddexp); each output is weighted by "
            "exp(its lse - the merged lse)."))
    if max_error(lse, whole[1], f"{task}: merge's lse") > TOL:
        raise CheckFailed(f"{task}: the merged lse is wrong: it is log(exp(lse) + exp(block_lse)), torch.logaddexp.")
    for name in ("nothing and a block", "nothing twice"):
        out, lse = _pair(task, f"merge ({name})", data[name])
        if out.isnan().any() or lse.isnan().any():
            raise CheckFailed(f"{task}: merge gave NaN for rows that saw no key ({name}): their lse is -inf on a side "
                              "(both, for some rows), and exp(-inf - -inf) is NaN. Where the merged lse is -inf, "
                              "the weights are 0 (and the row stays zeros).")
        want = b if name == "nothing and a block" else (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
        if max_error(out, want[0], f"{task}: merge's out ({name})") > TOL or \
                not torch.equal(torch.isinf(lse), torch.isinf(want[1])):
            raise CheckFailed(f"{task}: merging with rows that saw no key ({name}) should give the other side "
                              "unchanged, and rows that saw nothing anywhere stay zeros with lse -inf.")
    for causal in (False, True):
        ref, ref_lse = cp.reference(q, k, v, causal), cp.reference_lse(q, k, causal)
        for block in (T, 16, 5):
            (got, blocks) = data[f"{block}/{causal}"]
            out, lse = _pair(task, "blockwise_attention", got)
            where = f"blockwise_attention with block={block}, causal={causal}"
            want_blocks = [(T, min(block, T - s)) for s in range(0, T, block)]
            blocks = [tuple(b) for b in blocks] if isinstance(blocks, list) else blocks  # lists, once through JSON
            if not isinstance(blocks, list) or sorted(blocks) != sorted(want_blocks):
                raise CheckFailed(f"{task}: {where} called attend() on blocks of (queries, keys) {blocks[:6]}; expected "
                                  f"the whole sequence's queries against each block of {block} keys: {want_blocks[:6]}.")
            err = max_error(out, ref, f"{task}: {where}'s out")
            if err > TOL and isinstance(lse, torch.Tensor) and lse.shape == ref_lse.shape and \
                    (lse - torch.logaddexp(ref_lse, torch.zeros_like(ref_lse))).abs().max() < TOL:
                raise CheckFailed(f"{task}: {where} differs from SDPA by {err:.2e}, and its lse is log(1 + exp(the "
                                  "right lse)): it starts at 0, as if a key of score 0 had been seen. Start out at zeros "
                                  "and lse at -inf (nothing seen yet).")
            if err > TOL:
                raise CheckFailed(f"{task}: {where} differs from SDPA on the whole sequence by {err:.2e}."
                                  + (" With a causal mask, give attend() each block's positions in the whole sequence "
                                     "(its keys are at start..start+block-1), not 0..block-1." if causal else ""))
            if max_error(lse, ref_lse, f"{task}: {where}'s lse") > TOL:
                raise CheckFailed(f"{task}: {where}'s lse differs from the whole sequence's log-sum-exp.")
    return f": the merge is exact, NaN-free where rows see nothing, and blockwise attention equals SDPA (max error ≤ {TOL:g})"


check_blockwise = Check("Task 6.1", ("merge", "blockwise_attention"), collect_blockwise, judge_blockwise,
                        world_sizes=(), forbidden=_NO_LIBRARY)
"""Task 6.1: two partial attentions merged by their log-sum-exp; attention one key block at a time."""


# -- Tasks 6.2 and 6.3: ring attention -------------------------------------------------------------------------
LAYOUTS = ("contiguous", "zigzag")


def ring_job(fns, backward: bool, seed=None) -> dict:
    """On each rank, per layout and mask: the learner's ring attention (and its backward) on this rank's
    chunk, with the messages it sent and received (lablib's traced calls, with their peers)."""
    import torch.distributed as dist

    from ..comm import to_device, watched

    r, n = dist.get_rank(), dist.get_world_size()
    q, k, v = (to_device(t) for t in _inputs(seed))
    T = q.shape[-2]
    out = {}
    for layout in LAYOUTS:
        every = [to_device(cp.positions(layout, s, n, T)) for s in range(n)]
        mine = [t[..., every[r], :].contiguous() for t in (q, k, v)]
        for causal in (False, True):
            flight = blocks = None
            if not backward:
                cp._IN_FLIGHT[0], works = [], []
                try:
                    (got, ops), blocks = cp.blocks_of(watched, fns[0], *mine, every, causal, works=works, peers=True)
                finally:
                    flight, cp._IN_FLIGHT[0] = cp._IN_FLIGHT[0], None
            else:
                whole_out, whole_lse = cp.reference(q, k, v, causal), cp.reference_lse(q, k, causal)
                rows = every[r]
                dout = to_device(_grad_out(seed))[..., rows, :].contiguous()
                got, ops = watched(fns[0], *mine, every, whole_out[..., rows, :].contiguous(),
                                   whole_lse[..., rows].contiguous(), dout, causal, peers=True)
            out[f"{layout}/{causal}"] = {"got": list(got) if isinstance(got, (tuple, list)) else got, "ops": ops,
                                         "rows": every[r], "in_flight": flight, "blocks": blocks}
    return out


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


def _judge_ring(task, data, n, seed, backward: bool) -> float:
    q, k, v = (t.requires_grad_(backward) for t in _inputs(seed))
    if not isinstance(data, list) or len(data) != n:
        raise CheckFailed(f"{task}: expected one result per rank from {n} ranks.")
    B, H, T, D = shape(seed)
    chunk = B * H * (T // n) * D * 4
    worst = 0.0
    for causal in (False, True):
        want = cp.reference(q, k, v, causal)
        if backward:
            want.backward(_grad_out(seed))
            grads = [t.grad.detach().clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
        lse = cp.reference_lse(q.detach(), k.detach(), causal)
        for layout in LAYOUTS:
            for rank, per in enumerate(data):
                res = per[f"{layout}/{causal}"]
                rows, where = res["rows"], f"{layout} layout, causal={causal}, rank {rank}"
                got = _pair(task, "your function", res["got"]) if not backward else res["got"]
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
                        raise CheckFailed(f"{task}: {where}: {name} differs from SDPA's gradient by {errs[name]:.2e}. {hint}")
                    worst = max([worst, *errs.values()])
                    _messages(task, rank, n, res["ops"], n, 4 * chunk, "K, V, dK and dV", least=(2 * n - 1) * 2 * chunk)
                else:
                    out, got_lse = got
                    err = max_error(out, want.detach()[..., rows, :], f"{task}: {where}: out")
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


def _posted_first(task, data, n):
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


def collect_ring(fns, pool, seed):
    return run_on_ranks(pool, "Task 6.2", ring_job, fns, False, seed)


def judge_ring(data, world_size, seed) -> str:
    worst = _judge_ring("Task 6.2", data, world_size, seed, False)
    _posted_first("Task 6.2", data, world_size)
    return (f" on {world_size} ranks, contiguous and zig-zag, causal and not: equal to SDPA (max error {worst:.1e}), "
            f"K/V passed to the next rank in {world_size - 1} hop{'s' if world_size > 2 else ''}")


check_ring = Check("Task 6.2", ("ring_attention",), collect_ring, judge_ring, world_sizes=(2, 4),
                   forbidden=_NO_LIBRARY, every_size=True)
"""Task 6.2: ring attention, forward."""


def collect_ring_backward(fns, pool, seed):
    return run_on_ranks(pool, "Task 6.3", ring_job, fns, True, seed)


def judge_ring_backward(data, world_size, seed) -> str:
    worst = _judge_ring("Task 6.3", data, world_size, seed, True)
    return (f" on {world_size} ranks: dq, dk and dv equal SDPA's gradients (max error {worst:.1e}); dK and dV came "
            f"home after {world_size} hops")


check_ring_backward = Check("Task 6.3", ("ring_attention_backward",), collect_ring_backward, judge_ring_backward,
                            world_sizes=(2, 4), forbidden=_NO_LIBRARY, every_size=True)
"""Task 6.3: ring attention, backward."""


# -- Task 6.4: the zig-zag shard ---------------------------------------------------------------------------------
def collect_zigzag(fns, pool, seed):
    (fn,) = fns
    T = shape(seed)[2]
    x = torch.arange(T).view(1, 1, T, 1)
    return [[call_local("Task 6.4", fn, f"x of {T} tokens, rank={r}, world_size={n}", "It returns this rank's part "
                        "of x along dim -2.", x, r, n) for r in range(n)] for n in (1, 2, 3, 4)]


def judge_zigzag(data, world_size, seed) -> str:
    T = shape(seed)[2]
    for n, parts in zip((1, 2, 3, 4), data):
        for r, got in enumerate(parts):
            want = cp.positions("zigzag", r, n, T).view(1, 1, -1, 1)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
                raise CheckFailed(f"Task 6.4: with {n} rank(s) and {T} tokens, rank {r} should hold positions "
                                  f"{want.flatten().tolist()}, got {got.flatten().tolist() if isinstance(got, torch.Tensor) else got!r}: "
                                  "cut the sequence into 2 x world_size chunks; rank r takes chunks r and "
                                  "2 x world_size - 1 - r, in that order.")
    return ": every rank holds chunks r and 2P-1-r, at 1 to 4 ranks"


check_zigzag = Check("Task 6.4", ("zigzag_shard",), collect_zigzag, judge_zigzag, world_sizes=(), forbidden=_NO_LIBRARY)
"""Task 6.4: the zig-zag layout."""


# -- Task 6.5: all-to-all (Ulysses) attention -------------------------------------------------------------------
def ulysses_job(fn, seed=None) -> dict:
    import torch.distributed as dist

    from ..comm import to_device, watched

    r, n = dist.get_rank(), dist.get_world_size()
    q, k, v = (to_device(t) for t in _inputs(seed))
    out = {}
    for causal in (False, True):
        (got, ops), blocks = cp.blocks_of(watched, fn, *[t.chunk(n, -2)[r].contiguous() for t in (q, k, v)], causal)
        out[str(causal)] = {"got": got, "ops": ops, "blocks": blocks}
    return out


def collect_ulysses(fns, pool, seed):
    return run_on_ranks(pool, "Task 6.5", ulysses_job, fns[0], seed)


def judge_ulysses(data, world_size, seed) -> str:
    q, k, v = _inputs(seed)
    B, H, T, D = shape(seed)
    chunk = B * H * (T // world_size) * D * 4
    for causal in (False, True):
        want = cp.reference(q, k, v, causal)
        for rank, per in enumerate(data):
            res = per[str(causal)]
            err = max_error(res["got"], want.chunk(world_size, -2)[rank], f"Task 6.5: rank {rank}'s output")
            if err > TOL:
                raise CheckFailed(f"Task 6.5: causal={causal}, rank {rank}: the output differs from SDPA by {err:.2e}. "
                                  "After the all-to-all a rank holds every token of H/P heads, in sequence order "
                                  "(rank j's tokens in chunk j); attention runs on the whole sequence, then the "
                                  "all-to-all back returns each rank its own tokens of every head.")
            T = shape(seed)[2]
            if [tuple(b) for b in res["blocks"]] != [(T, T)]:
                raise CheckFailed(f"Task 6.5: rank {rank} called lablib.attend on blocks (queries, keys) {res['blocks'][:6]}; "
                                  f"after the all-to-all a rank attends once, every one of the {T} tokens of its heads.")
            names = {o.split()[0] for o in res["ops"]}
            sent = sum(int(o.split()[1]) for o in res["ops"])
            if names - {"all_to_all"} or sent != 4 * chunk:
                raise CheckFailed(f"Task 6.5: rank {rank} called {sorted(names)} with {sent} bytes in; Ulysses moves q, k "
                                  f"and v in and the output back with lablib.all_to_all only: 4 x {chunk} bytes.")
    return f" on {world_size} ranks: equal to SDPA, with all-to-alls of q, k, v and the output only"


check_ulysses = Check("Task 6.5", ("ulysses_attention",), collect_ulysses, judge_ulysses, world_sizes=(2, 4),
                      forbidden=_OWN, every_size=True)
"""Task 6.5: all-to-all (Ulysses) attention."""


# -- the notebook's measurements run the learner's functions once they have passed --------------------------
_TASKS = {"ring_attention": "Task 6.2", "ring_attention_backward": "Task 6.3", "ulysses_attention": "Task 6.5"}


def yours(**fns) -> dict:
    """{name: function} for the notebook's measurements: the learner's whose check passed in this kernel,
    lablib's for the others (printed)."""
    unknown = set(fns) - set(_TASKS)
    if unknown:
        raise TypeError(f"yours() takes {', '.join(_TASKS)}; got {', '.join(sorted(unknown))}")
    mine = whose(fns, {name: task for name, task in _TASKS.items() if name in fns})
    lablibs = answers("lab06")
    return {name: fns[name] if name in mine else getattr(lablibs, name) for name in _TASKS}
