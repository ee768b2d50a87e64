"""Pipeline schedules as data, before anything runs: per rank an ordered list of actions
``(kind, micro_batch, stage)``, stage s on rank s % p (p ranks, v stages per rank: v > 1 is the
interleaved schedule's "virtual stages"):

    F   forward of a micro-batch through a stage (its input comes from stage s-1, its output goes to s+1)
    B   backward: the gradient of the stage's input (sent to s-1) and, unless the schedule has W actions,
        of its weights
    W   the weights' gradient alone (zero-bubble schedules split B in two: B is on the critical path
        to the stage before, W is not and can fill idle time)

The schedules (each a function of p and m, the number of micro-batches):
- GPipe (Huang et al. 2019, arXiv:1811.06965): every forward, then every backward; holds all m
  micro-batches' activations.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): p-1-r forwards to fill the pipe, then
  one forward, one backward; the same bubble as GPipe, (p-1)/(m+p-1), but at most p micro-batches held.
- interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473, section 2.2): v stages per rank, each 1/v of
  the work; the bubble shrinks to (p-1)/(v*m+p-1) for v times the messages.
- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 3): 1F1B with B
  split into B and W, the W's late enough to fill the drain; bubble (p-1)(T_F+T_B-T_W), a third of
  1F1B's when F, B and W take equal time, for the same memory.

Then the validator (what each action needs, and the first action that can never start), the simulator
(times per action, no ranks), the activations a schedule holds and the papers' bubbles. Running a
schedule on ranks is pipeline.py's.
"""
from __future__ import annotations

from typing import NamedTuple

KINDS = ("F", "B", "W")


class Action(NamedTuple):
    kind: str   # "F", "B" or "W"
    mb: int     # micro-batch
    stage: int  # stage (on rank stage % p)

    def __str__(self):
        return f"{self.kind}{self.mb} of stage {self.stage}"


def as_actions(schedule, what: str = "the schedule") -> list[list[Action]]:
    """Per rank a list of ``Action``s, from any lists of (kind, mb, stage) triples; ValueError saying
    what is wrong otherwise."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"{what} is a {type(schedule).__name__}: expected a list with one list of actions per rank")
    out = []
    for r, row in enumerate(schedule):
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"{what}[{r}] is a {type(row).__name__}: expected rank {r}'s list of actions")
        acts = []
        for i, a in enumerate(row):
            if (not isinstance(a, (list, tuple)) or len(a) != 3 or a[0] not in KINDS
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in a[1:])):
                raise ValueError(f"{what}[{r}][{i}] is {a!r}: expected an action (kind, micro_batch, stage) with kind "
                                 "'F', 'B' or 'W', e.g. ('F', 0, 0)")
            acts.append(Action(*a))
        out.append(acts)
    return out


# -- lablib's schedules -------------------------------------------------------------------------------
def gpipe(p: int, m: int) -> list[list[Action]]:
    """Rank r: the forwards of every micro-batch, then their backwards."""
    return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(p)]


def naive(p: int) -> list[list[Action]]:
    """The whole batch as one micro-batch: GPipe with m = 1."""
    return gpipe(p, 1)


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Rank r: p-1-r forwards (the warm-up), then a forward and a backward in turn, then the backwards
    left (the cool-down)."""
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(m - warm, m)]
        out.append(acts)
    return out


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: rank r holds stages r, r+p, ..., r+(v-1)p. Micro-batches go in groups
    of p through one stage, then the group through the rank's next stage; backwards the same, stages in
    reverse. Warm-up: 2(p-1-r) + (v-1)p forwards, then one forward, one backward. m must divide by p."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batches in groups of p: m = {m} does not divide by p = {p}")
    total = m * v

    def fwd(k, r):
        return Action("F", (k // (p * v)) * p + k % p, r + p * ((k // p) % v))

    def bwd(k, r):
        return Action("B", (k // (p * v)) * p + k % p, r + p * (v - 1 - (k // p) % v))

    out = []
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        acts = [fwd(k, r) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(warm + k, r), bwd(k, r)]
        acts += [bwd(k, r) for k in range(total - warm, total)]
        out.append(acts)
    return out


def zb_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of F and B, with each W as late as memory allows: rank r runs W of micro-batch
    i after B of micro-batch i + r, so rank r defers r W's (rank 0 none, the last rank p - 1) and runs them
    in the cool-down, where 1F1B idles. The papers' bubble, (p-1)/(3m+p-1) with F = B = W, holds for
    m >= p."""
    out = []
    for r, row in enumerate(one_f_one_b(p, m)):
        acts, backs = [], 0
        for a in row:
            acts.append(a)
            if a.kind == "B":
                backs += 1
                if backs > r:
                    acts.append(Action("W", backs - 1 - r, r))
        acts += [Action("W", i, r) for i in range(max(0, m - r), m)]
        out.append(acts)
    return out


SCHEDULES = {"naive": lambda p, m, v=1: naive(p), "gpipe": lambda p, m, v=1: gpipe(p, m),
             "1f1b": lambda p, m, v=1: one_f_one_b(p, m), "interleaved": interleaved,
             "zb-h1": lambda p, m, v=1: zb_h1(p, m)}


# -- what a schedule needs, and the validator ------------------------------------------------------------
def needs(a: Action, stages: int, split: bool) -> list[Action]:
    """The actions ``a`` must wait for: F the forward on the stage before; B its own forward and the
    backward on the stage after; W the B it completes (``split``: the schedule has W actions)."""
    if a.kind == "F":
        return [Action("F", a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "B":
        return [Action("F", a.mb, a.stage)] + ([Action("B", a.mb, a.stage + 1)] if a.stage < stages - 1 else [])
    return [Action("B", a.mb, a.stage)]


class Problem(NamedTuple):
    rank: int
    index: int   # position in the rank's list (its length: something is missing)
    reason: str


def validate(schedule, m: int, v: int = 1) -> Problem | None:
    """The first problem of a schedule for p = len(schedule) ranks, v stages per rank and m micro-batches,
    before anything runs; None if it runs to the end. The rules (``RULES``), in order, each over the whole
    schedule:
    1. an action that cannot be on its rank (a stage not on it, a micro-batch out of range);
    2. an action listed a second time;
    3. an action missing (index = the rank's list length): every (stage, micro-batch) needs F and B, and W
       too if the schedule has any W;
    4. a deadlock: run every rank's list in order, each action once what it needs (``needs``) has run;
       when no rank can go on, the lowest such rank's next action, and why, down to the action it waits
       for in the end."""
    acts = as_actions(schedule)
    for _, rule in RULES:
        problem = rule(acts, m, v)
        if problem:
            return problem
    return None


def misplaced(acts: list[list[Action]], m: int, v: int) -> Problem | None:
    """Rule 1: the first action that cannot be on its rank."""
    p, stages = len(acts), len(acts) * v
    for r, row in enumerate(acts):
        for i, a in enumerate(row):
            if not 0 <= a.stage < stages or a.stage % p != r:
                return Problem(r, i, f"{a} is not on rank {r}: stage s runs on rank s % {p}"
                               + (f" (there are {stages} stages)" if not 0 <= a.stage < stages else ""))
            if not 0 <= a.mb < m:
                return Problem(r, i, f"{a}: micro-batches are 0..{m - 1}")
    return None


def listed_twice(acts: list[list[Action]], m: int, v: int) -> Problem | None:
    """Rule 2: the first action listed a second time (where it is listed again)."""
    seen = set()
    for r, row in enumerate(acts):
        for i, a in enumerate(row):
            if a in seen:
                return Problem(r, i, f"{a} is listed twice")
            seen.add(a)
    return None


def missing(acts: list[list[Action]], m: int, v: int) -> Problem | None:
    """Rule 3: the first action no rank lists, at the end of its rank's list."""
    p, listed = len(acts), {a for row in acts for a in row}
    split = any(a.kind == "W" for a in listed)
    for r in range(p):
        for s in range(r, p * v, p):
            for mb in range(m):
                for kind in ("FBW" if split else "FB"):
                    if Action(kind, mb, s) not in listed:
                        return Problem(r, len(acts[r]), f"rank {r} never runs {Action(kind, mb, s)}")
    return None


def deadlock(acts: list[list[Action]], m: int, v: int) -> Problem | None:
    """Rule 4 (rules 1-3 passed: every action is listed once, on its rank): the lowest rank's action that
    can never start."""
    p, stages = len(acts), len(acts) * v
    split = any(a.kind == "W" for row in acts for a in row)
    done, pos = set(), [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(acts[r]) and all(n in done for n in needs(acts[r][pos[r]], stages, split)):
                done.add(acts[r][pos[r]])
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(acts[r])]
    if not stuck:
        return None
    r = stuck[0]
    why = _chain(acts, pos, done, r, stages, split)
    return Problem(r, pos[r], f"rank {r}'s {acts[r][pos[r]]} can never start: it {why}")


def _chain(acts, pos, done, r, stages, split) -> str:
    """Why rank r's stuck action waits, to the root: what it needs, and, where that comes after the action
    its rank is stuck at, what that one needs in turn, until an action named already (every stuck rank
    waits on another: the chain ends in a cycle; rule 3 leaves no action unlisted)."""
    where = {a: (q, i) for q, row in enumerate(acts) for i, a in enumerate(row)}
    cycle = ", named above: a cycle, so none of these ever starts"
    a, named, text = acts[r][pos[r]], set(), ""
    while True:
        named.add(a)
        need = next(n for n in needs(a, stages, split) if n not in done)
        if need in named:
            return text + f"needs {need}{cycle}"
        owner, at = where[need]
        text += f"needs {need} (rank {owner}'s action {at}), which "
        named.add(need)
        a = acts[owner][pos[owner]]  # where rank `owner` is stuck: at need itself, or at an action before it
        if a != need:
            if a in named:
                return text + f"rank {owner} reaches only after {a}{cycle}"
            text += f"rank {owner} reaches only after {a} (its action {pos[owner]}), which "


RULES = (("an action that cannot be on its rank", misplaced), ("an action listed twice", listed_twice),
         ("an action missing", missing), ("a deadlock", deadlock))


# -- the simulator: unit times, no ranks ------------------------------------------------------------------
def simulate(schedule, times: dict, v: int = 1) -> list[list[tuple[Action, float, float]]]:
    """When each action would run if ``times[kind]`` (per stage) were all it took and messages were
    free: per rank (action, start, end). The schedule must be valid."""
    acts = as_actions(schedule)
    p = len(acts)
    stages, split = p * v, any(a.kind == "W" for row in acts for a in row)
    end: dict[Action, float] = {}
    out = [[] for _ in range(p)]
    free, pos = [0.0] * p, [0] * p
    while any(pos[r] < len(acts[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                deps = needs(a, stages, split)
                if not all(d in end for d in deps):
                    break
                t0 = max([free[r]] + [end[d] for d in deps])
                t1 = t0 + times[a.kind if a.kind != "B" or split else "BW"]
                end[a], free[r] = t1, t1
                out[r].append((a, t0, t1))
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError("the schedule deadlocks: validate() says where")
    return out


def bubble(runs) -> float:
    """The idle fraction of the step, averaged over ranks: 1 - busy time / step time."""
    t0 = min(run[0][1] for run in runs if run)
    t1 = max(run[-1][2] for run in runs if run)
    return 1 - sum(sum(e - s for _, s, e in run) for run in runs) / (len(runs) * (t1 - t0))


def in_flight(schedule) -> list[int]:
    """Per rank, the most (micro-batch, stage) pairs whose activations it holds at once: from F until B
    (or W, when the schedule splits the backward)."""
    acts = as_actions(schedule)
    split = any(a.kind == "W" for row in acts for a in row)
    peaks = []
    for row in acts:
        held = peak = 0
        for a in row:
            held += 1 if a.kind == "F" else -1 if a.kind == ("W" if split else "B") else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def theory(name: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction the papers give, with T_F = T_B(input) = T_W (a full backward = 2 T_F)."""
    if name in ("naive", "gpipe", "1f1b"):
        m = 1 if name == "naive" else m
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":  # (p-1)(T_F+T_B-T_W) idle against 3m units of work per rank
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"no schedule {name!r}: one of {', '.join(SCHEDULES)}")
