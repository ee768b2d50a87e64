"""Lab 10 (finding the bugs of distributed training): Task 10.1 (replica checksums), 10.2 (the factor a
gradient is off by) and 10.3 (the first point at which the ranks' flight recorders disagree), each run on
broken steps (``strategies.bugs``, ``strategies.hangs``) and judged against the truth found from what the ranks
returned, on hidden variants of each bug (another parameter, rank, factor) beside the notebook's; and 10.4
(each axis's reduction against the exact sum)."""
from __future__ import annotations

import math

import torch

from ..comm import op_bytes
from ..pool import Cluster
from ..strategies import bugs, hangs, probe
from . import Check, CheckFailed, answers, call_local, run_on_ranks, yours_of

FORBIDDEN = {
    "dist.*": "exercises move data with lablib's traced collectives only (lablib.all_gather, lablib.all_reduce, "
              "...); of torch.distributed they may ask get_rank and get_world_size, and use ReduceOp",
}
BYTES_PER_PARAM = 64  # what a checksum may send of each parameter, from each rank


def _plain(value):
    """A learner's answer as the judge compares it: tuples as lists, a dict's keys in order."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return [[_plain(k), _plain(v)] for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


# -- Task 10.1: replica checksums -----------------------------------------------------------------------------
def collect_replicas(fns, pool, seed):
    cases = bugs.REPLICA_CASES + (bugs.REPLICA_HIDDEN if seed is not None else ())
    out = {}
    for case in cases:
        res = run_on_ranks(pool, "Task 10.1", bugs.checksum_job, *fns, case, seed or 0)
        out[case] = [dict(r, said=repr(_plain(r["said"]))) for r in res]
    return out


_MISSED = {"one ulp": "differs from rank 0's in one element by one ulp, which a float sum rounds away: checksum the "
                      "bits (t.view(torch.int32)), summed as integers",
           "two swapped": "holds rank 0's values with two of them swapped: a sum, a mean or a norm of the values is "
                          "the same; weigh each element by its position before summing"}


def judge_replicas(data, world_size, seed) -> str:
    task, n = "Task 10.1", world_size
    for case, res in data.items():
        said = [r["said"] for r in res]
        if len(set(said)) > 1:
            raise CheckFailed(f"{task} ({case}): the ranks answered differently: "
                              + "; ".join(f"rank {r} {s}" for r, s in enumerate(said))
                              + ". Every rank must get every rank's checksums (an all-gather) and say the same.")
        truth = bugs.differing([[(name, t) for name, t in r["params"]] for r in res])
        want = repr(_plain(truth))
        for r, got in enumerate(res):
            sent = sum(op_bytes(got["ops"]).values())
            if sent > BYTES_PER_PARAM * len(got["params"]):
                raise CheckFailed(f"{task} ({case}): rank {r}'s collectives took in {sent} bytes for "
                                  f"{len(got['params'])} parameters: a checksum is a few numbers per parameter "
                                  f"(at most {BYTES_PER_PARAM} bytes each), not the parameters themselves.")
        if said[0] == want:
            continue
        if truth is None:
            raise CheckFailed(f"{task} ({case}): every rank holds the same bits in every parameter, and your diverged "
                              f"said {said[0]}: return None when every checksum equals rank 0's.")
        name, ranks = truth
        if said[0] == "None":
            why = _MISSED.get(case, f"differs from rank 0's on rank(s) {ranks}")
            raise CheckFailed(f"{task} ({case}): your diverged said None, but {name} {why}.")
        raise CheckFailed(f"{task} ({case}): your diverged said {said[0]}; expected {want}: {name} is the first "
                          f"parameter (in the model's order) whose bits differ from rank 0's, on rank(s) {ranks}.")
    return (f" on {world_size} ranks: each divergence named, its parameter and its ranks, from "
            f"{len(data)} broken steps, with a few bytes per parameter")


check_diverged = Check("Task 10.1", ("diverged",), collect_replicas, judge_replicas, world_sizes=(2, 4),
                       forbidden=FORBIDDEN)
"""Task 10.1: replica checksums compared across ranks."""


# -- Task 10.2: the factor a gradient is off by ---------------------------------------------------------------
def collect_parity(fns, pool, seed):
    cases = bugs.GRADIENT_CASES + (bugs.GRADIENT_HIDDEN if seed is not None else ())
    return {case: run_on_ranks(pool, "Task 10.2", bugs.parity_job, *fns, case, seed or 0) for case in cases}


def _number(said):
    if isinstance(said, torch.Tensor) and said.numel() == 1:
        said = said.item()
    return said if said is None or isinstance(said, (int, float)) and not isinstance(said, bool) else "?"


def judge_parity(data, world_size, seed) -> str:
    task, A = "Task 10.2", answers("lab10")
    for case, res in data.items():
        for r, got in enumerate(res):
            for (name, g), w, said in zip(got["got"], got["want"], got["said"]):
                want, said = A.factor(g, w), _number(said)
                where = f"{task} ({case}): rank {r}, {name}"
                if said == "?":
                    raise CheckFailed(f"{where}: factor returned {type(got['said'][0]).__name__}; return a number "
                                      "(a Python float) or None.")
                if want is None and said is not None:
                    raise CheckFailed(f"{where}: the distributed gradient is not a multiple of one process's (it "
                                      f"differs from the best multiple, {said if isinstance(said, float) else '?'}×, by "
                                      "more than 1e-3 of its size): return None when got - c·want is larger than that.")
                if want is not None and said is None:
                    raise CheckFailed(f"{where}: the distributed gradient is {want:.4g}× one process's, and factor "
                                      "said None.")
                if want is not None and (math.isnan(said) or abs(said - want) > 1e-3 * abs(want)):
                    nan = math.isnan(said) or math.isinf(said)
                    raise CheckFailed(f"{where}: the distributed gradient is {want:.4g}× one process's; factor said "
                                      f"{said}." + (" Some of this gradient's elements are exactly 0 in both (a ReLU unit "
                                                    "no input switched on): a ratio taken element by element divides "
                                                    "0 by 0. Fit one number to the whole tensor: c = <got, want> / "
                                                    "<want, want>." if nan else
                                                    " Compare the whole tensors, with their signs: c = <got, want> / "
                                                    "<want, want>." if abs(abs(said) - abs(want)) <= 1e-3 * abs(want)
                                                    else ""))
    return f" on {world_size} ranks: every parameter's factor, and None where a gradient is no multiple, in {len(data)} broken steps"


check_factor = Check("Task 10.2", ("factor",), collect_parity, judge_parity, world_sizes=(2, 4),
                     forbidden=FORBIDDEN)
"""Task 10.2: a distributed gradient against one process's, as the factor it is off by."""


# -- Task 10.3: where the ranks parted ------------------------------------------------------------------------
def collect_flights(fns, pool, seed):
    (first_mismatch,) = fns
    out = {}
    for case in hangs.CASES + (hangs.HIDDEN if seed is not None else ()):
        if case == "one fewer":  # it waits for the pool's timeout: a pool of its own, with a short one
            with Cluster(pool.world_size, backend=pool.backend, timeout=2.0, quiet=True, device=pool.device) as short:
                flights = hangs.flights(short, case, seed or 0)
        else:
            flights = hangs.flights(pool, case, seed or 0)
        said = call_local("Task 10.3", first_mismatch, "{rank: entries}", "Take {rank: list of entries} and return "
                          "None or (seq, {rank: entry or None}).", {r: list(e) for r, e in flights.items()})
        out[case] = {"said": repr(_plain(said)), "flights": [list(flights[r]) for r in range(pool.world_size)]}
    return out


def judge_flights(data, world_size, seed) -> str:
    task, A = "Task 10.3", answers("lab10")
    for case, got in data.items():
        flights = {r: [tuple(tuple(x) if isinstance(x, list) else x for x in e) for e in entries]
                   for r, entries in enumerate(got["flights"])}
        truth = A.first_mismatch(flights)
        want = repr(_plain(truth))
        if got["said"] == want:
            continue
        if truth is None:
            raise CheckFailed(f"{task} ({case}): every rank issued the same collectives, and first_mismatch said "
                              f"{got['said']}: return None when they agree.")
        seq, at = truth
        odd = [r for r, e in at.items() if e is None or e[1:6] != at[0][1:6]] if at.get(0) else [0]
        hint = ""
        if case == "one fewer":
            spans = ", ".join(f"rank {r} #{es[0][0]}-#{es[-1][0]}" for r, es in flights.items() if es)
            hint = (f" The recorders keep each rank's last 32 calls, and these hold {spans}: align the ranks by seq, "
                    "not by their place in the list, and a rank with no entry at a seq the others reached did not "
                    "issue it (None).")
        elif case == "dtype":
            hint = (" The odd rank's call took in as many bytes as the others' but another dtype and shape: compare "
                    "op, bytes, dtype, shape and group.")
        raise CheckFailed(f"{task} ({case}): first_mismatch said {got['said']}; the ranks part at #{seq}, where rank(s) "
                          f"{odd} issued another call than rank 0 (or none): expected {want}.{hint}")
    return f" on {world_size} ranks: where the ranks parted, in {len(data)} steps that hung, aborted or went wrong"


check_first_mismatch = Check("Task 10.3", ("first_mismatch",), collect_flights, judge_flights, world_sizes=(2, 4),
                             forbidden=FORBIDDEN, pool_only=(
                                 "its steps hang and make Gloo abort ranks on purpose, which a lablib pool's ranks "
                                 "survive (they are restarted) and torchrun's do not: run it in the notebook"))
"""Task 10.3: the first point at which the ranks' flight recorders disagree."""


# -- Task 10.4: the precision probe ---------------------------------------------------------------------------
def collect_probe(fns, pool, seed):
    cases = list(probe.CASES) + (list(probe.HIDDEN) if seed is not None else [])
    return {case: run_on_ranks(pool, "Task 10.4", probe.job, *fns, case, seed or 0) for case in cases}


def judge_probe(data, world_size, seed) -> str:
    task, seen = "Task 10.4", {}
    for case, res in data.items():
        for r, got in enumerate(res):
            for axis, one in got.items():
                exact = sum(res[q][axis]["x"].double() for q in one["ranks"])
                true = float((one["reduced"].double() - exact).norm() / exact.norm())
                said = _number(one["said"])
                where = f"{task} ({case}): rank {r}, the {axis} reduction"
                if said is None or said == "?":
                    raise CheckFailed(f"{where}: reduction_error returned {one['said']!r}; return its relative error "
                                      "as a number (a Python float).")
                seen[case, axis] = max(seen.get((case, axis), 0.0), true)
                if true > 1e-5 and said < 1e-5:
                    raise CheckFailed(f"{where} rounds: its error is {true:.2e}, and reduction_error said {said:.2e}. "
                                      "Compare reduce(x) with the exact sum, made from every rank's x in the group in "
                                      "float64 (lablib.all_gather(out, x.double(), group=group), then sum): a sum made "
                                      "the step's way rounds the same way.")
                everyone = sum(other[axis]["x"].double() for other in res)
                if len(one["ranks"]) < len(res) and abs(said - float((one["reduced"].double() - everyone).norm()
                                                                     / everyone.norm())) < 0.05 * said:
                    raise CheckFailed(f"{where}: its error is {true:.2e}, and reduction_error said {said:.2e}: the "
                                      "error against the sum over every rank. The exact sum is over the group's ranks "
                                      "only, the ones reduce sums over: lablib.all_gather(out, x.double(), group=group).")
                if abs(said - true) > 0.05 * max(true, 1e-5):
                    raise CheckFailed(f"{where}: its error is {true:.3e}, and reduction_error said {said:.3e}: the "
                                      "relative error of the whole tensor, |reduce(x) - exact| / |exact| (norms).")
    worst = max(seen, key=seen.get)
    return (f" on {world_size} ranks: each axis's reduction against the exact sum, in {len(data)} step{'s' * (len(data) > 1)} (the "
            f"largest error: {seen[worst]:.1e}, the {worst[1]} reduction of \"{worst[0]}\")")


check_probe = Check("Task 10.4", ("reduction_error",), collect_probe, judge_probe, world_sizes=(2, 4),
                    forbidden=FORBIDDEN)
"""Task 10.4: each reduction of a step against the exact sum."""


def yours(**fns) -> dict:
    """The learner's functions whose check passed here, lablib's for the others (``checks.whose``)."""
    return yours_of("lab10", fns)
