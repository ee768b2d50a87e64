"""Lab 05's answers: the schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1), the validator and the executor
(what an action needs, the simulator and the stages are the harness: ``strategies.schedules`` and
``strategies.pipeline``)."""
from __future__ import annotations

from typing import NamedTuple

from .. import messages
from ..strategies.schedules import Action, as_actions, message_deadlock, messages_of, needs, receives_after

TASKS = {"Task 5.1": ("gpipe", "one_f_one_b"), "Task 5.2": ("interleaved", "zb_h1"), "Task 5.3": ("validate",),
         "Task 5.4": ("execute",)}


# -- the schedules ------------------------------------------------------------------------------------------
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


# -- the validator -----------------------------------------------------------------------------------------
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
       for in the end;
    5. (lablib's, beyond Task 5.3) a deadlock of the messages: the executor's exchanges (``execute``) run
       under NCCL's rules (``schedules.message_deadlock``) stall, or match a message with another's."""
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


def messages_stall(acts: list[list[Action]], m: int, v: int) -> Problem | None:
    """Rule 5 (rules 1-4 passed): the first action the executor's messages never bring, under NCCL's rules."""
    found = message_deadlock(acts, v)
    return Problem(*found) if found else None


RULES = (("an action that cannot be on its rank", misplaced), ("an action listed twice", listed_twice),
         ("an action missing", missing), ("a deadlock", deadlock),
         ("a deadlock of the messages under NCCL's rules", messages_stall))


# -- the executor -------------------------------------------------------------------------------------------
def execute(stages: dict, actions, group=None) -> None:
    """Run this rank's actions in order: receive what an action needs, compute, send what it made on.
    ``group``: the pipeline's ranks, stage s's neighbours the group's ranks s ± 1 (None: every rank).

    Under NCCL a rank's sends and receives run one at a time, in the order posted, and a send completes only
    once its receive has begun: two neighbours that each send before they receive wait for each other for
    ever. So the send after an action goes as one ``lablib.exchange`` with the receive the next action needs
    (Megatron-LM's send_forward_recv_backward and send_backward_recv_forward). With several stages a rank
    (interleaved), an F between two B's sends with the B after it: one exchange of both sends and the next
    receives, as Megatron's interleaved schedule does; paired one by one, its rings of stages deadlock."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    n, acts = len(ranks), [Action(*a) for a in actions]
    split = any(a.kind == "W" for a in acts)
    plan = messages_of(acts, n, n * len(stages))
    source, target = ([None if r is None else ranks[r] for r in col] for col in list(zip(*plan))[:2] or ([], []))
    later = [held for *_, held in plan]
    inbox, carried, handles = {}, [], []  # inbox: action index -> (buffer, the handle that fills it)
    for i, (kind, mb, s) in enumerate(acts):
        stage, x = stages[s], None
        if source[i] is not None:
            if i not in inbox:
                x = stage.buffer()
                inbox[i] = (x, messages.irecv(x, source[i], name=f"recv {kind}{mb}"))
            x, handle = inbox.pop(i)
            handle.wait()
        if kind == "F":
            y = stage.forward(mb, x)
        elif kind == "B":
            y = stage.backward(mb, x, weights=not split)
        else:
            stage.backward_weight(mb)
            continue
        if target[i] is None:
            continue
        carried.append((y, target[i], f"send {kind}{mb}"))
        if later[i]:
            continue
        into = receives_after(plan, i)  # the next action's receive (and the one after a held F's)
        recvs = [(stages[acts[j].stage].buffer(), source[j], f"recv {acts[j].kind}{acts[j].mb}") for j in into]
        handle = messages.exchange(sends=carried, recvs=recvs)
        inbox.update({j: (buf, handle) for j, (buf, _, _) in zip(into, recvs)})
        handles.append(handle)
        carried = []
    for handle in handles:
        handle.wait()
