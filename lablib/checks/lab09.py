"""Lab 09 (what every real run also has): Task 9.1 (mixed precision on FSDP's units), 9.2 (fp16 loss scaling
every rank agrees on), 9.3 (gradient accumulation with one all-reduce) and 9.4 (a sharded checkpoint loaded
at another world size, in lab09_ckpt.py), judged against one process doing the same arithmetic and from what
each rank sent, wrote and read."""
from __future__ import annotations

import torch

from ..comm import op_bytes
from ..pool import PerRank
from ..strategies import accumulate as acc, harness, mixed, scaling
from ..strategies.flat import FlatLayout
from . import Check, CheckFailed, max_error, run_on_ranks, yours_of
from .lab09_ckpt import FORBIDDEN, check_checkpoint  # noqa: F401 - the notebook imports every check from here

HINTS = (("expected all tensors to be on the same device", "a tensor made without device=: make it on the device "
          "of the tensors you were given (device=grad.device)."),
         ("dtype", "a collective's input and output must have one dtype: all_gather into unit.flat (param_dtype) a "
          "shard cast to param_dtype; reduce-scatter into a tensor of the dtype you send."),)
_POLICIES = (mixed.Policy(torch.bfloat16, torch.float32), mixed.Policy(torch.bfloat16, torch.bfloat16))


# -- Task 9.1: mixed precision on FSDP's units --------------------------------------------------------------
def _mp_data(seed, n):
    return [harness.rank_data("mlp", 3, r, seed or 0) for r in range(n)]


def collect_mp(fns, pool, seed):
    data = PerRank(_mp_data(seed, pool.world_size))
    return {str(p): run_on_ranks(pool, "Task 9.1", mixed.train, *fns, p, "mlp", 3, mixed.SGD, data, hints=HINTS)
            for p in _POLICIES}


def _bytes(ops, kind: str) -> int:
    return op_bytes(ops).get(kind, 0)


def judge_mp(data, world_size, seed) -> str:
    task, n = "Task 9.1", world_size
    rows = _mp_data(seed, n)
    shard = [FlatLayout.of(list(u.parameters()), n).shard_numel for u in rows[0][0]]
    for policy in _POLICIES:
        res = data[str(policy)]
        for r, got in enumerate(res):
            ops = got["ops"]
            gathered, want_g = _bytes(ops, "all_gather"), 2 * sum(shard) * policy.param_dtype.itemsize
            if gathered != want_g:
                fp32 = gathered == 2 * want_g
                raise CheckFailed(f"{task} ({policy}): rank {r}'s all-gathers took in {gathered} bytes in a step; "
                                  f"{want_g} expected (each unit's shard, cast to {policy.param_dtype}, gathered "
                                  "before its forward and again before its backward)." + (
                                      " That is twice: you gathered the fp32 shard. Cast before the all-gather: "
                                      "half the bytes on the wire." if fp32 else ""))
            reduced, want_r = _bytes(ops, "reduce_scatter"), n * sum(shard) * policy.reduce_dtype.itemsize
            if reduced != want_r:
                raise CheckFailed(f"{task} ({policy}): rank {r}'s reduce-scatters took in {reduced} bytes; {want_r} "
                                  f"expected, every unit's padded gradient in {policy.reduce_dtype}: " + (
                                      "reduce-scatter the gradient (lablib.reduce_scatter), so each rank gets its shard "
                                      "of the sum." if not reduced else "cast the gradient to policy.reduce_dtype "
                                      "before the reduce-scatter, whatever dtype it came in."))
            if any(d != str(policy.param_dtype) for d in got["dtypes"]):
                raise CheckFailed(f"{task} ({policy}): the units computed with parameters of {got['dtypes']}; expected "
                                  f"{policy.param_dtype}: gather into unit.flat, whose views the module computes with.")
        ref = mixed.reference(policy, world_size=n, data=rows)
        tol = 2e-5 if policy.reduce_dtype == torch.float32 else 2e-4  # another backend's sum order moves a few ulps
        for r, got in enumerate(res):
            if not isinstance(got["params"], list) or len(got["params"]) != len(ref):
                raise CheckFailed(f"{task}: rank {r} returned no parameters.")
            err = max(max_error(a, b, f"{task}: rank {r}'s unit {i}") for i, (a, b) in enumerate(zip(got["params"], ref)))
            if err > tol:
                start = mixed.reference(policy, world_size=n, data=rows, steps=0)
                moved = [p - p0 for p, p0 in zip(got["params"], start)]
                step = [w - p0 for w, p0 in zip(ref, start)]
                ratio = sum((d * s).sum() for d, s in zip(moved, step)) / sum((s * s).sum() for s in step)
                why = (f" The parameters moved about {ratio:.2f}× as far as they should: the gradient was summed over "
                       f"the {n} ranks, not averaged (divide by ctx.world_size)." if abs(ratio - n) < 0.3 * n else "")
                raise CheckFailed(f"{task} ({policy}): after 3 steps rank {r}'s parameters differ from one process "
                                  f"doing the same arithmetic by {err:.2e} (tolerance {tol:g}).{why}")
    return f" on {n} ranks: bf16 gathers (half the bytes), gradients reduced in fp32 and in bf16 as the policy says"


check_mp = Check("Task 9.1", ("mp_unshard", "mp_reduce"), collect_mp, judge_mp, world_sizes=(2, 4),
                 forbidden=FORBIDDEN)
"""Task 9.1: mixed precision on FSDP's units."""


# -- Task 9.2: loss scaling every rank agrees on ------------------------------------------------------------
def collect_scaling(fns, pool, seed):
    n = pool.world_size
    cs = scaling.cases(n, seed or 0)
    share = PerRank([(cs["masters"][r], [g[r] for g in cs["grads"]]) for r in range(n)])
    return run_on_ranks(pool, "Task 9.2", scaling.job, fns[0], share, hints=HINTS)


def judge_scaling(data, world_size, seed) -> str:
    task, n = "Task 9.2", world_size
    cs = scaling.cases(n, seed or 0)
    ref = scaling.reference(cs["masters"], cs["grads"])
    for k, want in enumerate(ref["log"]):
        got = [res["log"][k] for res in data]
        spiked = cs["spikes"].get(k)
        stepped = [g["stepped"] for g in got]
        if any(s > 1 for s in stepped):
            raise CheckFailed(f"{task}: at step {k} step() was called {max(stepped)} times on one rank; once at most.")
        if len(set(stepped)) > 1:
            yes = [r for r, s in enumerate(stepped) if s]
            no = [r for r, s in enumerate(stepped) if not s]
            raise CheckFailed(
                f"{task}: at step {k} rank(s) {yes} stepped and rank(s) {no} skipped"
                + (f" (only rank {spiked}'s gradient shard overflowed)" if spiked is not None else "")
                + ": each rank decided from its own shard. From then on the ranks hold shards of different models. "
                  "Make the found-inf flag a tensor and all-reduce it with op=dist.ReduceOp.MAX, so that every rank "
                  "skips when any rank overflowed.")
        for r, g in enumerate(got):
            if g["returned"] is not bool(g["stepped"]):
                raise CheckFailed(f"{task}: at step {k} rank {r} returned {g['returned']!r} but "
                                  f"{'called' if g['stepped'] else 'did not call'} step(): return True if it stepped, "
                                  "False if it skipped.")
        if bool(stepped[0]) != want["stepped"]:
            raise CheckFailed(f"{task}: at step {k} every rank {'stepped' if stepped[0] else 'skipped'}; expected "
                              + (f"a skip: rank {spiked}'s scaled gradient holds an inf or a NaN (torch.isfinite)"
                                 if not want["stepped"] else "a step: no rank's scaled gradient overflowed (check the "
                                 "gradient for inf and NaN, not its size)") + ".")
        if stepped[0]:
            scale = ref["log"][k - 1]["scale"] if k else scaling.Scaler().scale
            for r, g in enumerate(got):
                want_g = scaling.scaled(cs["grads"][k][r], scale).float() / scale
                if max_error(g["grad"], want_g, f"{task}: the gradient rank {r} passed to step at step {k}") > 1e-6:
                    times = (g["grad"].double().norm() / want_g.double().norm()).item()
                    raise CheckFailed(f"{task}: at step {k} rank {r} passed step() a gradient {times:.4g}× the true one"
                                      + (": still scaled. Divide by scaler.scale first." if abs(times / scale - 1) < 1e-3
                                         else ": pass the unscaled gradient, grad.float() / scaler.scale.") )
        for r, g in enumerate(got):
            if g["scale"] != want["scale"] or g["good"] != want["good"]:
                raise CheckFailed(
                    f"{task}: after step {k} rank {r}'s scaler has scale {g['scale']:g} and good = {g['good']}; expected "
                    f"{want['scale']:g} and {want['good']}. On a skip: scale × scaler.backoff and good = 0; on a step: "
                    "good + 1, and when good reaches scaler.growth_interval, scale × scaler.growth and good = 0.")
    for r, res in enumerate(data):
        if max_error(res["master"], ref["masters"][r], f"{task}: rank {r}'s master shard") > 1e-6:
            raise CheckFailed(f"{task}: rank {r}'s master shard after {len(ref['log'])} steps differs from the reference.")
    skips = sum(not s["stepped"] for s in ref["log"])
    return f" on {n} ranks: {skips} overflows on one rank each skipped on every rank; the scale halved and grew"


check_scaling = Check("Task 9.2", ("scaled_update",), collect_scaling, judge_scaling, world_sizes=(4,),
                      forbidden=FORBIDDEN)
"""Task 9.2: loss scaling that every rank agrees on."""


# -- Task 9.3: gradient accumulation ----------------------------------------------------------------------------
def _micro(seed) -> int:
    return 3 if seed is None else 2 + seed % 3


def collect_accumulate(fns, pool, seed):
    share = PerRank(acc.rank_data(pool.world_size, _micro(seed), seed or 0))
    return run_on_ranks(pool, "Task 9.3", acc.job, fns[0], share, hints=HINTS)


def judge_accumulate(data, world_size, seed) -> str:
    task, n, k = "Task 9.3", world_size, _micro(seed)
    ref = acc.reference(acc.rank_data(n, k, seed or 0))
    for r, res in enumerate(data):
        sent, once = _bytes(res["ops"], "all_reduce"), res["param_bytes"]
        if sent != once:
            times = sent / once
            raise CheckFailed(f"{task}: rank {r} all-reduced {sent} bytes, {times:.3g}× the gradients' {once}"
                              + (f": once per micro-batch. Let the {k} micro-batches' gradients add up in p.grad, and "
                                 "all-reduce once, after the last." if abs(times - k) < 1e-9 else
                                 ": all-reduce each gradient once, after the last micro-batch."))
        if any(g is None for g in res["grads"]):
            raise CheckFailed(f"{task}: rank {r} left a parameter without a gradient: backward each micro-batch's "
                              "loss, and leave the averaged gradient in p.grad.")
        err = max(max_error(g, w, f"{task}: rank {r}'s gradient") for g, w in zip(res["grads"], ref))
        if err > 1e-5:
            ratio = (sum((g * w).sum() for g, w in zip(res["grads"], ref)) / sum((w * w).sum() for w in ref)).item()
            why = ((k, f"each micro-batch's loss was not divided by the {k} micro-batches"),
                   (n, f"the all-reduced gradient was summed over the {n} ranks, not averaged"),
                   (k * n, "neither divided by the micro-batches nor averaged over the ranks"),
                   (1 / n, "the gradient was divided by the ranks twice, or not all-reduced"))
            near = " or ".join(text for f, text in why if abs(ratio - f) < 0.05 * f)
            raise CheckFailed(f"{task}: rank {r}'s gradients differ from one process on the whole batch by {err:.2e}"
                              + (f"; they are {ratio:.3g}× it: {near}." if near else "."))
    return f" on {n} ranks: {k} micro-batches, one all-reduce of the gradients, equal to one process on the whole batch"


check_accumulate = Check("Task 9.3", ("accumulate",), collect_accumulate, judge_accumulate, world_sizes=(4,),
                         forbidden=FORBIDDEN)
"""Task 9.3: gradient accumulation."""


def yours(**fns) -> dict:
    """The learner's functions whose check passed here, lablib's for the others (``checks.whose``)."""
    return yours_of("lab09", fns)

