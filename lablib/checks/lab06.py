"""Lab 06 (context parallelism): Task 6.1 (the online-softmax merge and blockwise attention, one process),
6.2 (ring attention forward), 6.3 (its backward), 6.4 (the zig-zag shard) and 6.5 (all-to-all attention),
each against single-process SDPA (and its autograd) in fp32, judged from what each rank computed and sent:
a ring passes K/V chunks to its neighbour, one hop a step, and gathers nothing. The ring's rank job and judgement
are in ``lab06_ring``, the mistakes the messages name (from the data, never the code) in ``lab06_mistakes``."""
from __future__ import annotations

import re

import torch

from ..pool import PerRank
from ..pool.failures import NCCL_RULES
from ..rules.policy import COLLECTIVES
from ..strategies import context_parallel as cp
from . import Check, CheckFailed, answers, call_local, max_error, not_done, run_on_ranks, whose
from . import lab06_mistakes as mistakes
from .lab06_ring import TOL, inputs, judge_ring as _judge_ring, pair as _pair, posted_first, ring_job, shape, shares

_OWN = {"scaled_dot_product_attention": "the lab builds attention from lablib.attend; SDPA is the reference it is "
                                        "checked against",
        "~context_parallel": "PyTorch's context parallelism is what the lab compares with; build it yourself"}
_NO_LIBRARY = {**COLLECTIVES, **_OWN}


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
    q, k, v = inputs(seed)
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

def judge_blockwise(data, world_size, seed) -> str:
    task = "Task 6.1"
    q, k, v = inputs(seed)
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
_HOP_HINTS = ((NCCL_RULES, "a hop's send and receive were posted apart (lablib.isend, then lablib.irecv), and "
               "NCCL, whose rules these checks hold Gloo to, runs a rank's sends and receives one at a time in the order "
               "posted, a send waiting until its receive has begun: every rank sends first, and nobody receives. Post "
               "the hop as one lablib.exchange(sends=[(held, right)], recvs=[(incoming, left)])."),)


def collect_ring(fns, pool, seed):
    return run_on_ranks(pool, "Task 6.2", ring_job, fns, False, shares(seed, pool.world_size, False), hints=_HOP_HINTS)


def judge_ring(data, world_size, seed) -> str:
    worst = _judge_ring("Task 6.2", data, world_size, seed, False)
    posted_first("Task 6.2", data, world_size)
    return (f" on {world_size} ranks, contiguous and zig-zag, causal and not: equal to SDPA (max error {worst:.1e}), "
            f"K/V passed to the next rank in {world_size - 1} hop{'s' if world_size > 2 else ''}")


check_ring = Check("Task 6.2", ("ring_attention",), collect_ring, judge_ring, world_sizes=(2, 4),
                   forbidden=_NO_LIBRARY, every_size=True)
"""Task 6.2: ring attention, forward."""


def collect_ring_backward(fns, pool, seed):
    return run_on_ranks(pool, "Task 6.3", ring_job, fns, True, shares(seed, pool.world_size, True), hints=_HOP_HINTS)


def judge_ring_backward(data, world_size, seed) -> str:
    worst = _judge_ring("Task 6.3", data, world_size, seed, True)
    return (f" on {world_size} ranks: dq, dk and dv equal SDPA's gradients (max error {worst:.1e}); dK and dV came "
            f"home after {world_size} hops")


check_ring_backward = Check("Task 6.3", ("ring_attention_backward",), collect_ring_backward, judge_ring_backward,
                            world_sizes=(2, 4), forbidden=_NO_LIBRARY, every_size=True)
"""Task 6.3: ring attention, backward."""


# -- Task 6.4: the zig-zag shard ---------------------------------------------------------------------------------
def _shard(fn, *args):
    """The learner's zigzag_shard on one input: its tensor, or the exception it raised as text (a judge names
    an IndexError by what the other calls returned)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise not_done("Task 6.4", fn.__name__) from None
    except Exception as exc:  # noqa: BLE001 - any error is the learner's, reported by the judge
        return f"{type(exc).__name__}: {exc}"


def collect_zigzag(fns, pool, seed):
    (fn,) = fns
    T = shape(seed)[2]
    x = torch.arange(T).view(1, 1, T, 1)
    probe = _shard(fn, torch.zeros(8, 8, T, 8), 0, 2)  # every dim cuts into 4: which one did it cut?
    return {"parts": [[_shard(fn, x, r, n) for r in range(n)] for n in (1, 2, 3, 4)],
            "probe": {"shape": list(probe.shape)} if isinstance(probe, torch.Tensor) else {"error": str(probe)}}


def judge_zigzag(data, world_size, seed) -> str:
    T = shape(seed)[2]
    if not isinstance(data, dict) or "parts" not in data:
        raise CheckFailed("Task 6.4: expected the shards of every rank.")
    held = [[got.flatten().tolist() if isinstance(got, torch.Tensor) and got.dim() == 4 and got.shape[:2] == (1, 1)
             and got.shape[3] == 1 else got for got in parts] for parts in data["parts"]]
    wrong = [(n, r, got) for n, parts in zip((1, 2, 3, 4), held) for r, got in enumerate(parts)
             if not (isinstance(got, list) and got == cp.positions("zigzag", r, n, T).tolist())]
    if not wrong:
        return ": every rank holds chunks r and 2P-1-r, at 1 to 4 ranks"
    named = mistakes.zigzag_wrong_dim(data.get("probe"), T) or mistakes.zigzag_off_by_one(held, T)
    if named:
        raise CheckFailed(f"Task 6.4: {named}")
    n, r, got = wrong[0]
    if isinstance(got, str):
        raise CheckFailed(f"Task 6.4: zigzag_shard(x of {T} tokens, rank={r}, world_size={n}) raised {got}. It "
                          "returns this rank's part of x along dim -2: chunks r and 2 x world_size - 1 - r of "
                          "x.chunk(2 * world_size, -2).")
    want = cp.positions("zigzag", r, n, T).tolist()
    shown = got if isinstance(got, list) else f"a {type(got).__name__}" + (
        f" of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else "")
    raise CheckFailed(f"Task 6.4: with {n} rank(s) and {T} tokens, rank {r} should hold positions {want}, got {shown}: "
                      "cut the sequence into 2 x world_size chunks; rank r takes chunks r and 2 x world_size - 1 - r, "
                      "in that order.")


check_zigzag = Check("Task 6.4", ("zigzag_shard",), collect_zigzag, judge_zigzag, world_sizes=(), forbidden=_NO_LIBRARY)
"""Task 6.4: the zig-zag layout."""


# -- Task 6.5: all-to-all (Ulysses) attention -------------------------------------------------------------------
def ulysses_job(fn, share: list) -> dict:
    """On each rank: the learner's all-to-all attention on its own rows of q, k and v (``share``), both masks."""
    from ..comm import to_device, watched

    out = {}
    for causal in (False, True):
        mine = [to_device(t) for t in share]
        ((got, ops), blocks), queries = cp.queries_of(cp.blocks_of, watched, fn, *mine, causal)
        out[str(causal)] = {"got": got, "ops": ops, "blocks": blocks, "queries": queries[:1]}
    return out


_SPLIT = re.compile(r"input has (\d+) rows, which do not cut into (\d+) equal parts")


def _split_hint(found) -> str:
    return (f"the tensor you gave lablib.all_to_all has {found[1]} rows in dim 0, which it cuts into one chunk per "
            f"rank ({found[2]}): dim 0 must be the destination rank. x.reshape(B, P, H // P, T/P, D).transpose(0, "
            "1).contiguous() puts it first (without the transpose, dim 0 is the batch).")


def collect_ulysses(fns, pool, seed):
    n, qkv = pool.world_size, inputs(seed)
    share = PerRank([[t.chunk(n, -2)[r].contiguous() for t in qkv] for r in range(n)])  # each rank its own rows
    return run_on_ranks(pool, "Task 6.5", ulysses_job, fns[0], share, hints=((_SPLIT, _split_hint),))


def judge_ulysses(data, world_size, seed) -> str:
    q, k, v = inputs(seed)
    B, H, T, D = shape(seed)
    chunk = B * H * (T // world_size) * D * 4
    for causal in (False, True):
        want = cp.reference(q, k, v, causal)
        for rank, per in enumerate(data):
            res = per[str(causal)]
            err = max_error(res["got"], want.chunk(world_size, -2)[rank], f"Task 6.5: rank {rank}'s output")
            named = err > TOL and mistakes.ulysses_mistake((res.get("queries") or [None])[0], res["got"], q, want,
                                                           rank, world_size)
            if named:
                raise CheckFailed(f"Task 6.5: causal={causal}, the output differs from SDPA by {err:.2e}: {named}")
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
