"""Lab 03 (prefetch and overlap): Task 3.1 (an FSDP unit's four hooks), 3.2 (prefetching, any depth)
and 3.3 (reduce-scatters left running under the backward), each trained on the ranks against the
single-process reference, with what every unit held after every hook checked from the first step's log."""
from __future__ import annotations

import dataclasses
import re
import traceback

from .. import comm
from ..strategies import prefetch
from ..strategies.harness import Optimizer, reference, shares
from . import Check, CheckFailed, answers, params_error, run_on_ranks

MODELS, STEPS = ("mlp", "transformer"), 3
# Exercises call lablib's traced collectives, so the timeline shows them; torch.distributed's own are
# untraced.
_TRACED = {f"dist.{name}": "use lablib.all_gather / lablib.reduce_scatter: they are traced, so the timeline "
                           "shows what your hooks do" for name in (
    "all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor", "reduce_scatter_single",
    "reduce_scatter", "all_reduce", "_all_gather_base", "_reduce_scatter_base")}
_TRACED["dist.*"] = ("exercises move data with lablib's traced collectives only; of torch.distributed they may ask "
                     "get_rank and get_world_size")
_RANK_HINTS = (
    (re.compile(r"(\w+), your (\w+) hook(?: of unit \d+)?, (all-gathered into|used) a flat buffer with no storage"),
     lambda found: f"your {found[2]} hook ({found[1]}) {found[3]} a unit's flat buffer while its storage was freed "
                   "(0 bytes): resize the storage back first, unit.flat.untyped_storage().resize_("
                   "unit.layout.padded_numel * unit.flat.element_size()), then all-gather into it."),
    ("storage of size 0", "a unit computed while its flat buffer was freed: its pre-hook must resize the storage "
                          "back (unit.layout.padded_numel * unit.flat.element_size() bytes) and fill it with "
                          "the all-gather before the unit runs (and wait for it, if it is asynchronous)."),
    ("lost its output", "a unit was freed (reshard) while its prefetched gather was still in flight: wait for "
                        "a unit's gather before freeing it, and never free a unit that is about to compute."),
    ("no gradient shard", "post_backward must leave this rank's shard of the averaged gradient in unit.grad."),
    ("the whole (padded) gradient", "unit.grad must hold this rank's shard only: reduce-scatter the full gradient "
                                    "into a tensor of unit.layout.shard_numel and keep that."),
    ("full_grad() was called twice", "call unit.full_grad() once per backward and keep what it returns: it hands "
                                     "over the unit's gradients and frees them."),
    ("timed out", "one rank skipped a collective the others called: every rank must issue the same "
                  "collectives, in the same order."),
    ("gradient computation has been modified", "a unit's parameters changed between its forward and its backward."),
)


def hooks_job(hooks: prefetch.Hooks, depths, data: dict) -> dict:
    """On each rank: every model trained with ``hooks`` at every depth, on this rank's ``data``
    (``harness.shares``)."""
    hooks = prefetch.Hooks(**{f.name: _named(f.name, getattr(hooks, f.name)) for f in dataclasses.fields(hooks)})
    return {f"{model}/{d}": prefetch.train(hooks, model, STEPS, Optimizer(), depth=d, data=data[model])
            for model in MODELS for d in depths}


def _named(moment: str, fn):
    """``fn``, its errors on a freed buffer naming it, and lablib.all_gather when that is where it failed:
    PyTorch's "storage of size 0" reads the same whether a hook all-gathered into a buffer it did not resize
    or a unit computed on a freed one."""
    def hook(units, *rest):
        try:
            return fn(units, *rest)
        except RuntimeError as exc:
            if "storage of size 0" not in str(exc):
                raise
            gathering = any(f.name == "all_gather" and f.filename == comm.__file__
                            for f in traceback.extract_tb(exc.__traceback__))
            unit = f" of unit {rest[0]}" if len(rest) == 2 else ""
            did = "all-gathered into" if gathering else "used"
            raise RuntimeError(f"{getattr(fn, '__name__', 'hook')}, your {moment} hook{unit}, {did} a flat buffer with "
                               f"no storage: {exc}").with_traceback(exc.__traceback__) from None
    return hook


def _values(task: str, per_rank: list, n: int, key: str, hint: str, seed=None) -> float:
    model = key.split("/")[0]
    ref = reference(model, STEPS, n, seed=seed or 0)
    worst = 0.0
    for rank, result in enumerate(r[key] for r in per_rank):
        worst = max(worst, params_error(task, rank, f"{STEPS} steps of the {model}", result["params"], ref, hint))
    return worst


def _units(per_rank, key) -> int:
    return len(per_rank[0][key]["unit_bytes"])


def _walk(task: str, result: dict, expect, what: str, world_size: int) -> None:
    """Compare each logged moment of the first step with ``expect(moment, i) -> (gathered, pending)``:
    which units are whole, which collectives are in flight (each writing into its unit, moving its
    size), and which collectives the hook issued (the units that became whole, and after a unit's
    backward its reduce-scatter)."""
    sizes, before = result["unit_bytes"], []
    for entry in result["log"]:
        moment, i, gathered, pending = entry["moment"], entry["unit"], entry["gathered"], entry["pending"]
        want_gathered, want_pending = expect(moment, i)
        where = f"after {moment}" + (f" of unit {i}" if i is not None else "") + f" ({what})"
        if sorted(gathered) != sorted(want_gathered):
            raise CheckFailed(f"{task}: {where}, the units holding their full parameters should be "
                              f"{sorted(want_gathered) or 'none'}, yours: {sorted(gathered) or 'none'}. "
                              + _gather_hint(moment, i, set(gathered), set(want_gathered), result["log"]))
        if entry["stale"]:
            raise CheckFailed(f"{task}: {where}, unit {entry['stale'][0]} still holds a handle that was waited for "
                              "already: set unit.work = None after waiting, so unit.work always means \"in flight\".")
        got = sorted((j, op) for j, op, _, _ in pending)
        if got != sorted(want_pending):
            raise CheckFailed(f"{task}: {where}, the collectives issued and not waited for yet should be "
                              f"{_pairs(want_pending)}, yours: {_pairs(got)}. " + _pending_hint(moment, got, want_pending))
        for j, op, nbytes, into_unit in pending:
            want = sizes[j] // (world_size if op == "all_gather" else 1)
            if op == "reduce_scatter" and nbytes == want and not into_unit:
                raise CheckFailed(f"{task}: {where}, the reduce-scatter in unit {j}'s unit.work writes into a tensor "
                                  "that is no longer unit.grad: unit.grad was given another tensor while the "
                                  "reduce-scatter was in flight (e.g. unit.grad = unit.grad / ctx.world_size). The "
                                  "result lands in the tensor you passed, once wait() returns: keep unit.grad as it "
                                  "is until then, and divide it in place after waiting (unit.grad /= ctx.world_size).")
            if nbytes != want or not into_unit:
                raise CheckFailed(f"{task}: {where}, the {op.replace('_', '-')} in unit {j}'s unit.work is not unit "
                                  f"{j}'s: " + ("gather unit.shard into unit.flat." if op == "all_gather" else
                                                "reduce-scatter unit.full_grad() into unit.grad."))
        issued = sorted(tuple(x) for x in entry["issued"])
        want_issued = sorted([("all_gather", j) for j in set(want_gathered) - set(before)]
                             + ([("reduce_scatter", i)] if moment == "post_backward" else []))
        if issued != want_issued:
            raise CheckFailed(f"{task}: {where}, your hooks issued {_issued(issued)}, expected {_issued(want_issued)}. "
                              + _issued_hint(issued, want_issued, before))
        before = want_gathered


def _issued(pairs) -> str:
    return ", ".join(("an all-gather " if op == "all_gather" else "a reduce-scatter ")
                     + (f"of unit {j}" if j >= 0 else "into no unit's buffer") for op, j in pairs) or "nothing"


def _issued_hint(got, want, before) -> str:
    again = sorted(j for op, j in got if op == "all_gather" and j in before)
    if len(set(got)) < len(got) or again:
        return ((f"Unit {again[0]} was gathered already (it is whole, or its gather is in flight). " if again else "")
                + "A unit is gathered once per use: issue its gather only if its flat buffer has no storage yet.")
    if any(j < 0 for _, j in got):
        return "Every collective writes into its unit: an all-gather into unit.flat, a reduce-scatter into unit.grad."
    if len(got) < len(want):
        return ("Each unit that is needed must be gathered (its parameters come from the other ranks' shards), "
                "and each gradient reduce-scattered, every step.")
    return "Gather only the units named."


def _pairs(pairs) -> str:
    return ", ".join(f"unit {j}'s {op.replace('_', '-')}" for j, op in sorted(pairs)) or "none"


def _gather_hint(moment: str, i, got: set, want: set, log) -> str:
    # the backward gathering i+1, i+2, ...: the forward's direction, seen in the gathers it issued later in the step
    late = next(((e["unit"], j) for e in log if e["moment"] == "pre_backward" for op, j in e["issued"]
                 if op == "all_gather" and j > e["unit"]), None) if moment == "pre_backward" else None
    if late:
        return (f"The backward runs the units last to first, so at unit i prefetch_backward gathers i, i-1, ..., "
                f"i-depth: here unit{'s' if len(want) > 1 else ''} {', '.join(map(str, sorted(want, reverse=True)))}. "
                f"Yours gathers the forward's way, i, i+1, ...: at pre_backward of unit {late[0]} it gathered unit "
                f"{late[1]}, whose backward had run already.")
    if moment == "post_forward" and i in want and i not in got:
        return "Keep the last unit whole after its forward: its backward comes right after."
    if got - want and moment.startswith("post"):
        return "A unit's full parameters must be freed right after its forward and its backward (reshard)."
    if want - got and moment.startswith("pre"):
        return "Gather the units named (resize the flat buffer's storage, then all-gather into it)."
    return "Prefetch exactly ctx.depth units ahead: more holds more memory, fewer hides less."


def _pending_hint(moment: str, got, want) -> str:
    if any(op not in ("all_gather", "reduce_scatter") for _, op in got):
        return "Keep in unit.work the handle that lablib.all_gather(..., async_op=True) returns, and nothing else."
    if moment == "finish":
        return "finish must wait for every reduce-scatter still in flight (unit.work.wait(); unit.work = None)."
    if len(got) < len(want):
        return ("A prefetched collective must still be in flight here: issue it with async_op=True, keep its "
                "handle in unit.work, and wait for it only when its unit is about to compute (or in finish, for "
                "a reduce-scatter). Set unit.work = None after waiting.")
    return "Wait for a unit's all-gather (unit.work.wait(); unit.work = None) before that unit computes."


# -- Task 3.1: the four hooks, synchronous -----------------------------------------------------------------
def _plain_expect(units: int):
    def expect(moment, i):
        if moment in ("pre_forward", "pre_backward"):
            return [i], []
        return [], []
    return expect


def collect_hooks(fns, pool, seed):
    pre_f, post_f, pre_b, post_b = fns
    return run_on_ranks(pool, "Task 3.1", hooks_job, prefetch.Hooks(pre_f, post_f, pre_b, post_b), (0,),
                        shares(MODELS, STEPS, pool.world_size, seed), hints=_RANK_HINTS)


def judge_hooks(data, world_size, seed) -> str:
    task = "Task 3.1"
    if not isinstance(data, list) or len(data) != world_size:
        raise CheckFailed(f"{task}: expected one result per rank from {world_size} ranks.")
    worst = 0.0
    for model in MODELS:
        key = f"{model}/0"
        for rank, r in enumerate(data):
            _walk(task, r[key], _plain_expect(_units(data, key)), f"the {model}, rank {rank}", world_size)
        worst = max(worst, _values(task, data, world_size, key, "post_backward must reduce-scatter the unit's "
                                   "full gradient (unit.full_grad()) into this rank's shard, divide it by the "
                                   "world size and keep it in unit.grad.", seed))
        for rank, r in enumerate(data):
            held = r[key]["held"]["params"]
            shards = sum(b // world_size for b in r[key]["unit_bytes"])
            if held != shards:
                raise CheckFailed(f"{task}: between steps rank {rank} holds {held} bytes of parameters, expected "
                                  f"{shards} (its shards): free every unit after its backward.")
    return (f" on {world_size} ranks: the MLP (padded) and the transformer block match the single-process "
            f"reference (max error {worst:.1e}); each unit is whole only between its pre- and post-hooks")


check_hooks = Check("Task 3.1", ("pre_forward", "post_forward", "pre_backward", "post_backward"), collect_hooks,
                    judge_hooks, world_sizes=(2, 4), forbidden=_TRACED, every_size=True)
"""Task 3.1: an FSDP unit's four hooks (gather, free, gather, reduce-scatter and free)."""


# -- Task 3.2: prefetching at depth 0, 1, 2 ----------------------------------------------------------------
DEPTHS = (0, 1, 2)


def prefetch_expect(units: int, d: int, last_kept: bool = True):
    last = units - 1

    def ahead(i):
        return list(range(i + 1, min(i + d, last) + 1))

    def behind(i):
        return list(range(max(i - d, 0), i))

    def expect(moment, i):
        if moment == "pre_forward":
            return [i] + ahead(i), [(j, "all_gather") for j in ahead(i)]
        if moment == "post_forward":
            return ahead(i) + ([i] if i == last and last_kept else []), [(j, "all_gather") for j in ahead(i)]
        if moment == "pre_backward":
            return behind(i) + [i], [(j, "all_gather") for j in behind(i)]
        if moment == "post_backward":
            return behind(i), [(j, "all_gather") for j in behind(i)]
        return [], []
    return expect


def collect_prefetch(fns, pool, seed):
    fwd, post_f, bwd, post_b = fns  # the backward's reduce-scatters: the learner's Task 3.1 post_backward
    hooks = prefetch.Hooks(fwd, post_f, bwd, post_b)
    return run_on_ranks(pool, "Task 3.2", hooks_job, hooks, DEPTHS, shares(MODELS, STEPS, pool.world_size, seed),
                        hints=_RANK_HINTS)


def judge_prefetch(data, world_size, seed) -> str:
    task = "Task 3.2"
    if not isinstance(data, list) or len(data) != world_size:
        raise CheckFailed(f"{task}: expected one result per rank from {world_size} ranks.")
    for model in MODELS:
        for d in DEPTHS:
            key = f"{model}/{d}"
            for rank, r in enumerate(data):
                _walk(task, r[key], prefetch_expect(_units(data, key), d), f"the {model}, depth {d}, rank {rank}",
                      world_size)
            _values(task, data, world_size, key, "Wait for a unit's gather before it computes. (The check runs your "
                    "Task 3.1 post_backward too: if its check fails, fix that first.)", seed)
    return (f" on {world_size} ranks at depths {', '.join(map(str, DEPTHS))}: each unit's gather is issued "
            "ctx.depth units early and waited for just before it computes; the values match the reference")


check_prefetch = Check("Task 3.2", ("prefetch_forward", "keep_last_post_forward", "prefetch_backward", "post_backward"),
                       collect_prefetch, judge_prefetch, world_sizes=(4,), forbidden=_TRACED, after=("Task 3.1",))
"""Task 3.2: forward and backward prefetching, ctx.depth units ahead; the last unit kept after forward. It
runs with the learner's post_backward of Task 3.1 (lablib's answers are not in the grading box)."""


# -- Task 3.3: reduce-scatters under the backward ------------------------------------------------------------
def overlap_expect(units: int, d: int = 1):
    base = prefetch_expect(units, d)

    def expect(moment, i):
        gathered, pending = base(moment, i)
        if moment == "finish":
            return [], []
        if moment in ("pre_backward", "post_backward"):
            done = range(i + 1 if moment == "pre_backward" else i, units)  # units whose backward has run
            pending = pending + [(j, "reduce_scatter") for j in done]
        return gathered, pending
    return expect


def collect_overlap(fns, pool, seed):
    post_b, finish, fwd, post_f, bwd = fns  # with the learner's prefetching hooks of Task 3.2
    hooks = prefetch.Hooks(fwd, post_f, bwd, post_b, finish)
    return run_on_ranks(pool, "Task 3.3", hooks_job, hooks, (1,), shares(MODELS, STEPS, pool.world_size, seed),
                        hints=_RANK_HINTS)


def judge_overlap(data, world_size, seed) -> str:
    task = "Task 3.3"
    if not isinstance(data, list) or len(data) != world_size:
        raise CheckFailed(f"{task}: expected one result per rank from {world_size} ranks.")
    for model in MODELS:
        key = f"{model}/1"
        for rank, r in enumerate(data):
            _walk(task, r[key], overlap_expect(_units(data, key)), f"the {model}, rank {rank}", world_size)
        _values(task, data, world_size, key, "finish must wait for every reduce-scatter still in flight and divide "
                "each unit's gradient shard by the world size.", seed)
    return (f" on {world_size} ranks: every reduce-scatter stays in flight under the backward of the units "
            "before it, finish collects them, and the values match the reference")


check_overlap = Check("Task 3.3", ("overlap_post_backward", "finish", "prefetch_forward", "keep_last_post_forward",
                                   "prefetch_backward"), collect_overlap, judge_overlap, world_sizes=(4,),
                      forbidden=_TRACED, after=("Task 3.1", "Task 3.2"))
"""Task 3.3: each unit's reduce-scatter left running under the backward of the units before it, with the
learner's prefetching hooks of Task 3.2."""


# -- the notebook's measurements run the learner's hooks once they have passed ---------------------------
_TASKS = {"pre_forward": "Task 3.1", "post_forward": "Task 3.1", "pre_backward": "Task 3.1",
          "post_backward": "Task 3.1", "prefetch_forward": "Task 3.2", "keep_last_post_forward": "Task 3.2",
          "prefetch_backward": "Task 3.2", "overlap_post_backward": "Task 3.3", "finish": "Task 3.3"}


def yours(**fns) -> tuple[prefetch.Hooks, prefetch.Hooks]:
    """(plain hooks, prefetching hooks) for the notebook's measurements: each of the learner's functions
    whose task's check passed in this kernel, lablib's for the others (a hook not checked yet may be wrong
    or hang). Prints whose are used."""
    from . import whose

    mine = whose(fns, _TASKS)
    lablibs = answers("lab03")
    chosen = {k: fns[k] if k in mine else getattr(lablibs, k) for k in _TASKS}
    plain = prefetch.Hooks(chosen["pre_forward"], chosen["post_forward"], chosen["pre_backward"], chosen["post_backward"])
    ahead = prefetch.Hooks(chosen["prefetch_forward"], chosen["keep_last_post_forward"], chosen["prefetch_backward"],
                           chosen["overlap_post_backward"], chosen["finish"])
    return plain, ahead
