"""Pipeline schedules as data, before anything runs: per rank an ordered list of actions
``(kind, micro_batch, stage)``, stage s on rank s % p (p ranks, v stages per rank: v > 1 is the
interleaved schedule's "virtual stages"):

    F   forward of a micro-batch through a stage (its input comes from stage s-1, its output goes to s+1)
    B   backward: the gradient of the stage's input (sent to s-1) and, unless the schedule has W actions,
        of its weights
    W   the weights' gradient alone (zero-bubble schedules split B in two: B is on the critical path
        to the stage before, W is not and can fill idle time)

The schedules (each a function of p and m, the number of micro-batches; lablib's, the answers to lab 05's
tasks with the validator, are in ``lablib.answers.lab05``):
- GPipe (Huang et al. 2019, arXiv:1811.06965): every forward, then every backward; holds all m
  micro-batches' activations.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): p-1-r forwards to fill the pipe, then
  one forward, one backward; the same bubble as GPipe, (p-1)/(m+p-1), but at most p micro-batches held.
- interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473, section 2.2): v stages per rank, each 1/v of
  the work; the bubble shrinks to (p-1)/(v*m+p-1) for v times the messages.
- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 3): 1F1B with B
  split into B and W, the W's late enough to fill the drain; bubble (p-1)(T_F+T_B-T_W), a third of
  1F1B's when F, B and W take equal time, for the same memory.

Here: what each action needs, lab 05's executor's messages under NCCL's rules (``message_deadlock``), the
simulator (times per action, no ranks), the activations a schedule holds and the papers' bubbles. Running a schedule on ranks is pipeline.py's.
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


def from_text(rows) -> list[list[Action]]:
    """A schedule written as text, one string per rank: "F2.0 B1.3" is the forward of micro-batch 2 through
    stage 0, then the backward of micro-batch 1 through stage 3."""
    out = []
    for r, row in enumerate(rows):
        acts = []
        for word in row.split():
            mb, _, stage = word[1:].partition(".")
            if word[:1] not in KINDS or not mb.isdigit() or not stage.isdigit():
                raise ValueError(f"rank {r}'s {word!r}: expected an action as F, B or W, the micro-batch, a dot and "
                                 "the stage, e.g. F2.0")
            acts.append(Action(word[0], int(mb), int(stage)))
        out.append(acts)
    return out


# -- what an action needs ---------------------------------------------------------------------------------
def needs(a: Action, stages: int, split: bool) -> list[Action]:
    """The actions ``a`` must wait for: F the forward on the stage before; B its own forward and the
    backward on the stage after; W the B it completes (``split``: the schedule has W actions)."""
    if a.kind == "F":
        return [Action("F", a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "B":
        return [Action("F", a.mb, a.stage)] + ([Action("B", a.mb, a.stage + 1)] if a.stage < stages - 1 else [])
    return [Action("B", a.mb, a.stage)]


# -- the executor's messages under NCCL's rules -------------------------------------------------------------
def messages_of(row, p: int, stages: int) -> list[tuple]:
    """Lab 05's executor on one rank's actions, as data: per action the rank it receives from, the rank it
    sends to (None where it does not) and whether its send waits for the next action's: with more than one
    stage a rank (interleaved), an F between two B's that both send goes with the B after it. (With one
    stage a rank, holding it would stall the next stage for a whole backward.)"""
    src = [((a.stage - 1) % p if a.kind == "F" and a.stage > 0 else (a.stage + 1) % p
            if a.kind == "B" and a.stage < stages - 1 else None) for a in row]
    dst = [((a.stage + 1) % p if a.kind == "F" and a.stage < stages - 1 else (a.stage - 1) % p
            if a.kind == "B" and a.stage > 0 else None) for a in row]
    held = [stages > p and a.kind == "F" and dst[i] is not None and 0 < i < len(row) - 1 and row[i - 1].kind == "B"
            and row[i + 1].kind == "B" and dst[i + 1] is not None for i, a in enumerate(row)]
    return list(zip(src, dst, held))


def receives_after(plan, i: int) -> list[int]:
    """The actions whose receives go in the exchange after action ``i`` (``plan``: ``messages_of``): the next
    that receives, and if its send is held (an F between two B's), the next after it too, up to the action
    that sends next; W's and actions that neither send nor receive are passed over."""
    out = []
    for j in range(i + 1, len(plan)):
        src, dst, held = plan[j]
        if src is not None:
            out.append(j)
        if (dst is not None or src is not None) and not held:
            break
    return out


def _program(row, p: int, stages: int) -> list[tuple]:
    """The executor's steps on one rank: ("post", sends, recvs) with messages as (what, peer), what being the
    action a message goes into, and ("run", action, the index of the post its input came by, or None)."""
    plan, steps, came_by, carried = messages_of(row, p, stages), [], {}, []
    into = lambda a: (a.kind, a.mb, a.stage + 1 if a.kind == "F" else a.stage - 1)  # noqa: E731
    for i, a in enumerate(row):
        src, dst, held = plan[i]
        if src is not None and i not in came_by:
            came_by[i] = len(steps)
            steps.append(("post", [], [((a.kind, a.mb, a.stage), src)]))
        steps.append(("run", a, came_by.get(i)))
        if dst is None:
            continue
        carried.append((into(a), dst))
        if held:
            continue
        recvs = []
        for j in receives_after(plan, i):
            came_by[j] = len(steps)
            recvs.append(((row[j].kind, row[j].mb, row[j].stage), plan[j][0]))
        steps.append(("post", carried, recvs))
        carried = []
    return steps


def message_deadlock(acts, v: int):
    """Rule 5 (rules 1-4 passed): lab 05's executor's messages under NCCL's rules. Each rank's posts run one
    at a time in order; a post completes once every receive of its sends has begun and every send of its
    receives has; messages between two ranks match in the order posted. Returns (rank, index, reason) for
    the lowest rank's first action that never runs, or for a message matched with another; else None."""
    p = len(acts)
    progs = [_program(row, p, p * v) for row in acts]
    count, slot = {}, {}  # per (src, dst, side) how many so far; per (rank, step) its messages' keys
    for r, steps in enumerate(progs):
        for k, step in enumerate(steps):
            if step[0] == "post":
                keys = []
                for side, msgs in (("s", step[1]), ("r", step[2])):
                    for what, peer in msgs:
                        pair = (r, peer) if side == "s" else (peer, r)
                        n = count[pair + (side,)] = count.get(pair + (side,), -1) + 1
                        keys.append((side, pair + (n,), what))
                slot[r, k] = keys
    sent, received = {}, {}  # message key -> what, once its post has begun
    queue, at, head, done = [[] for _ in range(p)], [0] * p, [0] * p, set()
    moved = True
    while moved:
        moved = False
        for r, steps in enumerate(progs):
            while at[r] < len(steps):
                step = steps[at[r]]
                if step[0] == "run" and step[2] is not None and (r, step[2]) not in done:
                    break
                if step[0] == "post":
                    queue[r].append(at[r])
                at[r] += 1
                moved = True
            while head[r] < len(queue[r]):
                k = queue[r][head[r]]
                for side, key, what in slot[r, k]:
                    (sent if side == "s" else received)[key] = what
                if not all(key in (received if side == "s" else sent) for side, key, _ in slot[r, k]):
                    break
                for side, key, what in slot[r, k]:
                    if side == "r" and sent[key] != what:
                        i = next(i for i, a in enumerate(acts[r]) if (a.kind, a.mb, a.stage) == what)
                        return r, i, (f"rank {r}'s {acts[r][i]} would receive the message for {Action(*sent[key])}: "
                                      f"rank {key[0]} sends its messages to rank {r} in another order than rank {r} "
                                      "receives them, and messages between two ranks match in the order posted")
                done.add((r, k))
                head[r] += 1
                moved = True
    for r, steps in enumerate(progs):
        if at[r] < len(steps):
            step = steps[at[r]]
            i = acts[r].index(step[1])
            return r, i, (f"rank {r}'s {step[1]} never runs: its input comes with the executor's exchanges, and "
                          "under NCCL's rules they wait for each other (each rank's sends and receives run one at a "
                          "time in the order posted, a send completes only once its receive has begun)")
    return None


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
    raise ValueError(f"no schedule {name!r}: one of naive, gpipe, 1f1b, interleaved, zb-h1")
