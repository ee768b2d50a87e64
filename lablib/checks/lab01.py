"""Lab 01 (sharding): Tasks 1.1-1.2 (flat shards, in this process) and 1.3-1.5 (ZeRO-1, ZeRO-2 and
ZeRO-3 steps, trained on the ranks against the single-process reference)."""
from __future__ import annotations

import random

import torch

from ..memory import STAGE_NAMES, zero_formula
from ..strategies.flat import FlatLayout
from ..strategies.fsdp import ZeRO3
from ..strategies.harness import Optimizer, reference, shares, train
from ..strategies.zero import ZeRO1, ZeRO2
from ..toy import build_model
from . import Check, CheckFailed, answers, call_local, params_error, run_on_ranks

# -- Task 1.1: a rank's flat shard ---------------------------------------------------------------------
def flat_cases(seed: int | None = None) -> list[tuple[int, int]]:
    if seed is None:
        return [(numel, n) for numel in (1, 5, 7, 8, 13) for n in (1, 2, 3, 4)]
    rng = random.Random(seed)
    return [(rng.randint(1, 40), n) for _ in range(5) for n in (1, 2, 3, 4, 5)]


def collect_flat_shard(fns, pool, seed, task="Task 1.1") -> list:
    """The learner's shard of every case: [[shard of rank 0, ...] per case]."""
    (fn,) = fns
    out = []
    for numel, n in flat_cases(seed):
        flat = torch.arange(1, numel + 1, dtype=torch.float32)
        out.append([call_local(task, fn, f"a flat buffer of {numel} elements, world_size={n}, rank={rank}",
                               "Every rank gets a shard of the same size, even when there are fewer "
                               "elements than ranks: pad first, then slice.", flat.clone(), n, rank)
                    for rank in range(n)])
    return out


def judge_flat_shard(data, world_size=None, seed=None, task="Task 1.1") -> str:
    cases = flat_cases(seed)
    if not isinstance(data, list) or len(data) != len(cases):
        raise CheckFailed(f"{task}: expected the shards of {len(cases)} cases.")
    for (numel, n), shards in zip(cases, data):
        layout = FlatLayout(((numel,),), n)
        padded = layout.flatten([torch.arange(1, numel + 1, dtype=torch.float32)])
        if not isinstance(shards, list) or len(shards) != n:
            raise CheckFailed(f"{task}: expected {n} shards for {numel} elements on {n} ranks.")
        for rank, got in enumerate(shards):
            start, end = layout.shard_bounds(rank)
            want = padded[start:end]
            if not isinstance(got, torch.Tensor):
                raise CheckFailed(f"{task}: return a tensor (the shard), got {type(got).__name__}")
            if got.numel() != want.numel():
                raise CheckFailed(
                    f"{task}: with {numel} elements on {n} ranks, rank {rank}'s shard has {got.numel()} "
                    f"elements, expected {want.numel()}. Did you pad the flat buffer to a multiple of "
                    f"world_size ({layout.padded_numel}) before splitting it into equal shards?")
            if not torch.equal(got.flatten(), want):
                raise CheckFailed(
                    f"{task}: with {numel} elements on {n} ranks, rank {rank}'s shard is {got.tolist()}, "
                    f"expected {want.tolist()}: rank r holds elements [r*s, (r+1)*s) of the padded buffer "
                    f"(s = {want.numel()}), and the padding is zeros at the very end.")
    numels = [numel for numel, _ in cases]
    return f": {sum(n for _, n in cases)} shards for 1-{max(n for _, n in cases)} ranks and {min(numels)}-{max(numels)} elements, padding included"


_ANSWERS = {"FlatLayout": "it is lablib's answer to this task; write the arithmetic yourself"}

check_flat_shard = Check("Task 1.1", ("flat_shard",), collect_flat_shard, judge_flat_shard, world_sizes=(),
                         forbidden=_ANSWERS)
"""Task 1.1: pad a flat buffer to a multiple of world_size; rank r gets the r-th equal slice."""


# -- Task 1.2: which part of which parameter a shard holds ------------------------------------------------
def slice_cases(seed: int | None = None) -> list[list[int]]:
    rng = random.Random(1 if seed is None else seed)
    cases = [[518, 1406, 266], [10, 2], [3], [4, 4], [1, 1, 1, 1, 1]]
    cases += [[p.numel() for p in unit.parameters()] for unit in build_model("transformer")]
    return cases + [[rng.randint(1, 20) for _ in range(rng.randint(1, 5))] for _ in range(30)]


def collect_shard_slices(fns, pool, seed, task="Task 1.2") -> list:
    """The learner's slices for every case and world size 1-4: [[slices of rank 0, ...], ...]."""
    (fn,) = fns
    return [[call_local(task, fn, f"numels={list(numels)}, world_size={n}, rank={rank}",
                        "Parameters are laid out in order in the flat buffer; a rank's shard is "
                        "[rank*s, (rank+1)*s) with s = ceil(total/world_size).", list(numels), n, rank)
             for rank in range(n)]
            for numels in slice_cases(seed) for n in (1, 2, 3, 4)]


def judge_shard_slices(data, world_size=None, seed=None, task="Task 1.2") -> str:
    cases = [(numels, n) for numels in slice_cases(seed) for n in (1, 2, 3, 4)]
    if not isinstance(data, list) or len(data) != len(cases):
        raise CheckFailed(f"{task}: expected the slices of {len(cases)} cases.")
    for (numels, n), per_rank in zip(cases, data):
        layout = FlatLayout(tuple((k,) for k in numels), n)
        if not isinstance(per_rank, list) or len(per_rank) != n:
            raise CheckFailed(f"{task}: expected the slices of {n} ranks for {numels}.")
        for rank, got in enumerate(per_rank):
            want = answers("lab01").shard_slices(numels, n, rank)
            try:
                got = [tuple(int(v) for v in item) for item in got]
            except (TypeError, ValueError):
                raise CheckFailed(f"{task}: return a list of (param, param_start, shard_start, length) "
                                  f"tuples, got {got!r}") from None
            if got != want:
                hint = ""
                if {w[0] for w in want} - {g[0] for g in got}:
                    hint = (" A parameter that crosses a shard boundary appears in both shards, each with its "
                            "own part; one that ends exactly at a boundary does not reach the next shard.")
                elif [w[0] for w in want] == [g[0] for g in got]:
                    hint = (" The parameters are right; check the offsets: param_start counts from the start "
                            "of the parameter, shard_start from the start of this rank's shard.")
                raise CheckFailed(f"{task}: for parameters of {numels} elements on {n} ranks (shard size "
                                  f"{layout.shard_numel}), rank {rank} should hold {want}, got {got}.{hint}")
    return f": {sum(n for _, n in cases)} shards of {len(cases) // 4} parameter lists on 1-4 ranks"


check_shard_slices = Check("Task 1.2", ("shard_slices",), collect_shard_slices, judge_shard_slices, world_sizes=(),
                           forbidden=_ANSWERS)
"""Task 1.2: which part of which parameter each rank's shard holds."""


# -- Tasks 1.3-1.5: ZeRO steps, trained on the ranks ------------------------------------------------------
_STAGE_HINTS = {
    "zero1": "Did you divide the all-reduced gradient by the world size, update only this rank's slice "
             "(unit.grad[start:end]) with ctx.update, and all-gather unit.shard into unit.flat afterwards?",
    "zero2": "reduce_scatter leaves this rank the *sum* of its shard of the gradients: divide it by the world "
             "size, keep it as unit.grad, update with it, then all-gather the parameters.",
    "zero3": "unshard must make room for the full parameters again (resize the flat buffer's storage to "
             "padded_numel * element_size bytes) and all-gather every rank's unit.shard into unit.flat.",
}
_REBOUND = ("unit.flat is not the unit's full-size buffer any more. reshard must free the flat buffer's storage in "
            "place (unit.flat.untyped_storage().resize_(0)) and keep unit.flat the same tensor: binding unit.flat to a "
            "new tensor leaves the model's parameters pointing at the old buffer, and unshard then gathers into a "
            "tensor of the wrong size.")
_RANK_HINTS = (
    ("lablib.all_gather: the output has shape", _REBOUND),  # lablib's words for it
    ("invalid tensor size", _REBOUND),                        # Gloo's, from dist.all_gather_into_tensor
    ("storage of size 0", "unshard gathers into unit.flat, whose storage reshard freed: resize it back to "
                          "unit.layout.padded_numel * unit.flat.element_size() bytes before the all-gather."),
    ("timed out", "one rank skipped a collective the others called: every rank must call the same "
                  "collectives, in the same order, for every unit."),
)
_MEMORY_HINTS = {
    ("zero1", "optimizer"): "ZeRO-1 keeps optimizer state for this rank's shard only: pass "
                            "unit.grad[start:end], not the whole gradient, to ctx.update.",
    ("zero2", "grads"): "ZeRO-2 keeps only this rank's shard of the gradient: set unit.grad to the "
                        "reduce-scattered shard so the full gradient is freed.",
    ("zero2", "optimizer"): "pass this rank's gradient shard, not the full gradient, to ctx.update.",
    ("zero3", "params"): "between uses ZeRO-3 keeps only the shard: reshard must free the full flat "
                         "buffer (unit.flat.untyped_storage().resize_(0)).",
}
MODELS, STEPS = ("mlp", "transformer"), 3


def train_job(strategy, data: dict) -> dict:
    """On each rank: both models trained with ``strategy`` on this rank's ``data`` (``harness.shares``):
    parameters, bytes held and Ψ per model, and the collectives the training issued (as lablib's traced calls
    recorded them)."""
    from ..comm import watched

    out = {}
    for model in MODELS:
        out[model], ops = watched(train, strategy, model, STEPS, Optimizer(), False, 0, data[model])
        out[model]["ops"] = sorted({op.split(" ")[0] for op in ops})
    return out


def judge_zero(task: str, stage: str, per_rank: list, n: int, seed=None) -> str:
    if not isinstance(per_rank, list) or len(per_rank) != n:
        raise CheckFailed(f"{task}: expected one result per rank from {n} ranks.")
    worst = 0.0
    for model in MODELS:
        ref = reference(model, STEPS, n, seed=seed or 0)
        for rank, result in enumerate(r[model] for r in per_rank):
            worst = max(worst, params_error(task, rank, f"{STEPS} steps of the {model}", result["params"], ref,
                                            _STAGE_HINTS[stage]))
            if stage == "zero2" and not ("reduce_scatter" in result["ops"] and "all_reduce" not in result["ops"]):
                raise CheckFailed(f"{task}: rank {rank}'s steps issued {', '.join(result['ops'])}. ZeRO-2 reduce-scatters "
                                  "the gradients (lablib.reduce_scatter): each rank needs only the sum of its own shard, "
                                  "so no rank receives, or holds for a moment, the whole summed gradient an all-reduce "
                                  "gives.")
            expected = zero_formula(stage, sum(u.numel() + (-u.numel()) % n for u in ref), n, mixed=False,
                                    state_bytes=4)
            for kind in ("params", "grads", "optimizer"):
                if result["memory"][kind] != expected[kind]:
                    hint = _MEMORY_HINTS.get((stage, kind), _STAGE_HINTS[stage])
                    raise CheckFailed(f"{task}: the values are right, but rank {rank} holds "
                                      f"{result['memory'][kind]} bytes of {kind} after a step, expected "
                                      f"{expected[kind]:.0f}. {hint}")
    return (f" on {n} ranks: the MLP and the transformer block match the single-process reference (max error "
            f"{worst:.1e}), and each rank holds exactly what {STAGE_NAMES[stage]} keeps")


def _zero_check(task: str, stage: str, make, params: tuple) -> Check:
    def collect(fns, pool, seed):
        return run_on_ranks(pool, task, train_job, make(*fns), shares(MODELS, STEPS, pool.world_size, seed),
                            hints=_RANK_HINTS)

    def judge(data, world_size, seed):
        return judge_zero(task, stage, data, world_size, seed)

    return Check(task, params, collect, judge, world_sizes=(4,))


check_zero1 = _zero_check("Task 1.3", "zero1", lambda step: ZeRO1(step=step), ("zero1_step",))
"""Task 1.3: the learner's ZeRO-1 step."""
check_zero2 = _zero_check("Task 1.4", "zero2", lambda step: ZeRO2(step=step), ("zero2_step",))
"""Task 1.4: the learner's ZeRO-2 step."""
check_zero3 = _zero_check("Task 1.5", "zero3", lambda unshard, reshard: ZeRO3(unshard=unshard, reshard=reshard),
                          ("unshard", "reshard"))
"""Task 1.5: the learner's ZeRO-3 unshard and reshard."""
