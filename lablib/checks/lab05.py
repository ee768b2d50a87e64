"""Lab 05 (pipeline bubbles): Task 5.1 (GPipe and 1F1B as data), 5.2 (interleaved 1F1B and ZB-H1), 5.3 (the validator)
and 5.4 (the executor on real ranks). Schedules are judged by what they do, not by their order: each must run to the
end (lablib's validator), hold no more activations than the schedule allows, and, simulated with the papers' unit
times, leave exactly the papers' bubble. The executor's gradients are judged against one process and PyTorch's
``torch.distributed.pipelining`` schedules on the same model (not under a seed: its first use costs seconds)."""
from __future__ import annotations

import random
import re

from ..strategies import pipeline as pp
from ..strategies import schedules as sc
from ..strategies import pp_reference as ref
from ..pool.failures import NCCL_RULES
from . import Check, CheckFailed, answers, call_local, max_error, run_on_ranks
from .lab05_cases import _bank, _validate_cases

FORBIDDEN = {
    "dist.*": "stages talk through lablib's traced point-to-point calls (lablib.exchange, lablib.irecv), so the "
              "checks and the timeline see them; of torch.distributed they may ask get_rank and get_world_size",
    "pipelining": "torch.distributed.pipelining is what the lab compares with; build the schedule yourself",
    "~Schedule": "torch.distributed.pipelining is what the lab compares with; build the schedule yourself",
    "PipelineStage": "torch.distributed.pipelining is what the lab compares with; build the schedule yourself",
}
_TIMES = {"F": 1.0, "BW": 2.0, "B": 1.0, "W": 1.0}  # the papers' unit times: a full backward is 2 forwards


def _schedule(task, name, got, p, m, v=1):
    """The learner's schedule as Actions, valid, or CheckFailed naming the first problem."""
    call = f"{name}({p}, {m}{f', {v}' if v > 1 else ''})"
    try:
        acts = sc.as_actions(got, f"{call}")
    except ValueError as exc:
        raise CheckFailed(f"{task}: {exc}.") from None
    if len(acts) != p:
        raise CheckFailed(f"{task}: {call} returned {len(acts)} lists; expected one per rank, {p}.")
    problem = answers("lab05").validate(acts, m, v)
    if problem:
        raise CheckFailed(f"{task}: {call} cannot run: {problem.reason}.")
    return acts


def _bubble(task, call, acts, p, m, v, want, what):
    times = {k: t / v for k, t in _TIMES.items()}
    got = sc.bubble(sc.simulate(acts, times, v))
    if got > want + 1e-9:
        split = any(a.kind == "W" for row in acts for a in row)
        unit = (f"F = B = W = {times['F']:g}" if split else
                f"F = {times['F']:g}, B = {times['BW']:g} (a full backward)") + (" per stage" if v > 1 else "")
        raise CheckFailed(f"{task}: {call}, simulated with {unit}, leaves a bubble of {got:.3f} of the step; {what} "
                          f"leaves {want:.3f}.")
    return got


def _cases(seed, fixed, draw):
    if seed is None:
        return fixed
    rng = random.Random(seed)
    return [draw(rng) for _ in range(4)]


# -- Task 5.1: GPipe and 1F1B ------------------------------------------------------------------------------
_CASES_51 = [(2, 4), (4, 4), (4, 8), (4, 2), (3, 5)]


def _simple_cases(seed):
    return _cases(seed, _CASES_51, lambda rng: (rng.randint(2, 5), rng.randint(1, 9)))


def _same_cases(task, data, cases, keys):
    """The data holds exactly the cases the seed draws (the judge trusts no count or size from the box)."""
    if not isinstance(data, list) or [tuple(c.get(k) for k in keys) if isinstance(c, dict) else None
                                      for c in data] != [tuple(c) for c in cases]:
        raise CheckFailed(f"{task}: the results are not those of the cases the check ran.")


def collect_simple(fns, pool, seed):
    gpipe, one_f_one_b = fns
    cases = _simple_cases(seed)
    return [{"p": p, "m": m,
             "gpipe": call_local("Task 5.1", gpipe, f"{p}, {m}", "It returns per rank a list of (kind, mb, stage).", p, m),
             "1f1b": call_local("Task 5.1", one_f_one_b, f"{p}, {m}", "It returns per rank a list of (kind, mb, stage).",
                                p, m)} for p, m in cases]


def judge_simple(data, world_size, seed) -> str:
    task = "Task 5.1"
    _same_cases(task, data, _simple_cases(seed), ("p", "m"))
    for case in data:
        p, m = case["p"], case["m"]
        acts = _schedule(task, "gpipe", case["gpipe"], p, m)
        for r, row in enumerate(acts):
            if "".join(a.kind for a in row) != "F" * m + "B" * m:
                raise CheckFailed(f"{task}: gpipe({p}, {m}) on rank {r} runs " + " ".join(f"{a.kind}{a.mb}" for a in row)
                                  + ". GPipe runs every micro-batch's forward, then the backwards (no W).")
        _bubble(task, f"gpipe({p}, {m})", acts, p, m, 1, sc.theory("gpipe", p, m), "GPipe, (p-1)/(m+p-1),")
        acts = _schedule(task, "one_f_one_b", case["1f1b"], p, m)
        if any(a.kind == "W" for row in acts for a in row):
            raise CheckFailed(f"{task}: one_f_one_b({p}, {m}) has W actions; 1F1B's backward is one B.")
        held = sc.in_flight(acts)
        for r in range(p):
            if held[r] > min(m, p - r):
                raise CheckFailed(f"{task}: one_f_one_b({p}, {m}) holds {held[r]} micro-batches' activations on rank {r} at "
                                  f"once; 1F1B holds at most {min(m, p - r)} there (p - rank: the warm-up's p-1-rank "
                                  "forwards, then one forward before each backward).")
        _bubble(task, f"one_f_one_b({p}, {m})", acts, p, m, 1, sc.theory("1f1b", p, m), "1F1B, like GPipe, (p-1)/(m+p-1),")
    cases = ", ".join(f"(p={c['p']}, m={c['m']})" for c in data)
    return (f" for {cases}: both run to the end with the bubble (p-1)/(m+p-1); GPipe holds m micro-batches, "
            "1F1B at most p - rank")


check_simple = Check("Task 5.1", ("gpipe", "one_f_one_b"), collect_simple, judge_simple, world_sizes=(),
                     forbidden=FORBIDDEN)
"""Task 5.1: GPipe and 1F1B as per-rank lists of actions."""


# -- Task 5.2: interleaved 1F1B and ZB-H1 -------------------------------------------------------------------
_CASES_52 = [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 2)]


def _draw_advanced(rng):
    p = rng.randint(2, 4)
    return p, p * rng.randint(1, 3), rng.randint(2, 3)


def collect_advanced(fns, pool, seed):
    interleaved, zb_h1 = fns
    hint = "It returns per rank a list of (kind, mb, stage)."
    return [{"p": p, "m": m, "v": v,
             "interleaved": call_local("Task 5.2", interleaved, f"{p}, {m}, {v}", hint, p, m, v),
             "zb": call_local("Task 5.2", zb_h1, f"{p}, {m}", hint, p, m)} for p, m, v in _cases(seed, _CASES_52, _draw_advanced)]


def judge_advanced(data, world_size, seed) -> str:
    task = "Task 5.2"
    _same_cases(task, data, _cases(seed, _CASES_52, _draw_advanced), ("p", "m", "v"))
    for case in data:
        p, m, v = case["p"], case["m"], case["v"]
        acts = _schedule(task, "interleaved", case["interleaved"], p, m, v)
        _bubble(task, f"interleaved({p}, {m}, {v})", acts, p, m, v, sc.theory("interleaved", p, m, v),
                "interleaved 1F1B, (p-1)/(v·m+p-1),")
        most = sc.in_flight(answers("lab05").interleaved(p, m, v))
        held = sc.in_flight(acts)
        for r in range(p):
            if held[r] > most[r]:
                raise CheckFailed(f"{task}: interleaved({p}, {m}, {v}) holds {held[r]} (micro-batch, stage) activations "
                                  f"on rank {r} at once; the interleaved 1F1B warm-up, 2(p-1-rank) + (v-1)p forwards, "
                                  f"holds at most {most[r]}. Go from forward-backward pairs as soon as the warm-up "
                                  "is done.")
        acts = _schedule(task, "zb_h1", case["zb"], p, m)
        if not any(a.kind == "W" for row in acts for a in row):
            raise CheckFailed(f"{task}: zb_h1({p}, {m}) has no W actions: a zero-bubble schedule splits each backward "
                              "into B (the input's gradient) and W (the weights').")
        held = sc.in_flight(acts)
        if max(held) > p:
            r = held.index(max(held))
            raise CheckFailed(f"{task}: zb_h1({p}, {m}) holds {held[r]} micro-batches' activations on rank {r} at once "
                              f"(from F until W); ZB-H1 keeps 1F1B's memory, at most p = {p}: a W may wait, but not "
                              "longer than that.")
        _bubble(task, f"zb_h1({p}, {m})", acts, p, m, 1, sc.theory("zb-h1", p, m),
                "ZB-H1 (T_F = T_B = T_W = 1), (p-1)/(3m+p-1),")
    cases = ", ".join(f"(p={c['p']}, m={c['m']}, v={c['v']})" for c in data)
    return (f" for {cases}: interleaved 1F1B leaves (p-1)/(v·m+p-1) and ZB-H1 (p-1)/(3m+p-1) of the step idle, "
            "within 1F1B's memory")


check_advanced = Check("Task 5.2", ("interleaved", "zb_h1"), collect_advanced, judge_advanced, world_sizes=(),
                       forbidden=FORBIDDEN)
"""Task 5.2: interleaved 1F1B (v stages per rank) and ZB-H1 (B split into B and W)."""


def collect_validate(fns, pool, seed, cases):
    (validate,) = fns
    out = []
    for schedule, m, v in cases:
        rows = [[list(a) for a in row] for row in schedule]
        got = call_local("Task 5.3", validate, f"schedule, {m}, {v}", "It returns None or (rank, index, reason).",
                         [[tuple(a) for a in row] for row in rows], m, v)
        out.append(list(got) if isinstance(got, tuple) else got)
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _order(schedule, m, v, got) -> str:
    """Which rule the learner's answer is, when it is a later rule's than the one that comes first."""
    acts = sc.as_actions(schedule)
    found = [(k, name, rule(acts, m, v)) for k, (name, rule) in enumerate(answers("lab05").RULES[:3], 1)]  # rule 4 assumes 1-3 hold
    first = next(((k, name) for k, name, problem in found if problem), (4, answers("lab05").RULES[3][0]))
    later = next(((k, name) for k, name, problem in found if problem and k > first[0] and isinstance(got, list)
                  and list(got[:2]) == [problem.rank, problem.index]), None)
    if later is None:
        return ("(Rules in order: wrong rank or micro-batch, listed twice, missing, then the deadlock's lowest stuck "
                "rank.)")
    return (f"Yours is what rule {later[0]} finds ({later[1]}), but rule {first[0]} ({first[1]}) comes first: check "
            "the whole schedule against each rule, in order, before the next.")


def _task_rules(schedule, m, v):
    """What Task 5.3's four rules find first (lablib's validate adds a fifth, the messages' deadlock)."""
    acts = sc.as_actions(schedule)
    return next((found for _, rule in answers("lab05").RULES[:4] if (found := rule(acts, m, v))), None)


def judge_validate(data, world_size, seed) -> str:
    task = "Task 5.3"
    names = {i: what for i, (*_, what) in enumerate(_bank())} if seed is None else {}
    cases = _validate_cases(seed)
    if not isinstance(data, list) or len(data) != len(cases):
        raise CheckFailed(f"{task}: the results are not those of the {len(cases)} schedules the check ran.")
    for i, ((schedule, m, v), got) in enumerate(zip(cases, data)):
        want = _task_rules(schedule, m, v)
        what = names.get(i, "this schedule")
        show = "\n".join(f"  rank {r}: " + " ".join(f"{k}{mb}/{s}" for k, mb, s in row) for r, row in enumerate(schedule))
        if want is None:
            if got is not None:
                raise CheckFailed(f"{task}: validate found a problem, {_short(got)}, in {what}, which runs to the end (m = "
                                  f"{m}, v = {v}; each action as kind, micro-batch/stage):\n{show}")
            continue
        if got is None:
            raise CheckFailed(f"{task}: validate returned None for {what}; expected rank {want.rank}'s action "
                              f"{want.index}: {want.reason}.\n{show}")
        if (not isinstance(got, list) or len(got) != 3 or not isinstance(got[2], str) or not got[2].strip()
                or list(got[:2]) != [want.rank, want.index]):
            raise CheckFailed(f"{task}: validate returned {_short(got)} for {what}; expected (rank, index, reason) with rank "
                              f"{want.rank} and index {want.index}: {want.reason}. "
                              f"{_order(schedule, m, v, got)}\n{show}")
    return f": the right action named in each of {len(data)} schedules, valid and broken"


check_validate = Check("Task 5.3", ("validate",), collect_validate, judge_validate, world_sizes=(), forbidden=FORBIDDEN,
                       given=lambda world_size, seed: _validate_cases(seed))
"""Task 5.3: the first action of a schedule that can never start, found before anything runs."""


# -- Task 5.4: the executor -----------------------------------------------------------------------------------
_HINTS = (
    # lablib's point-to-point calls refuse a peer outside the world (Gloo would wait for it until the timeout)
    (re.compile(r"rank (\d+) of (\d+) failed: ValueError: lablib\.i?(send|recv) (?:to|from) rank (-?\d+), but "
                r"the world has"),
     lambda found: f"rank {found[1]} {'sent to' if found[3] == 'send' else 'received from'} rank {found[4]}, but the "
                   f"world has {found[2]} ranks: stage s runs on rank s % world_size, so the stage after s is on rank "
                   "(s + 1) % world_size and the one before on (s - 1) % world_size."),
    # NCCL's rules (lablib.p2p): the interleaved schedule's rings of stages need an F's send to go with the B after it
    (re.compile(re.escape(NCCL_RULES) + r"(?s:.*)while running the interleaved schedule"),
     "the interleaved schedule deadlocks under NCCL's rules, which these checks hold Gloo to, when each send goes "
     "with only the next action's receive: with v stages a rank the stages form rings, and each rank's send waits for "
     "a neighbour that is itself sending. An F between two B's sends with the B after it: one lablib.exchange of "
     "both sends and the receives of the next F and B, as Megatron-LM's interleaved schedule does."),
    # every rank that timed out was in a send: sends that wait for their receiver
    (re.compile(r"timed out after \S+ s waiting for a peer: rank \d+ in send(, rank \d+ in send)*$", re.M),
     "every rank is blocked in a send: a blocking send (lablib.send) returns only once its peer has received, "
     "and the peer is sending too. Post the send after an action with the receive the next action needs, as one "
     "lablib.exchange, and wait on it before the next action."),
    (NCCL_RULES,
     "a deadlock under NCCL's rules, which these checks hold Gloo to: each rank's sends and receives run one at a "
     "time in the order posted, and a send completes only once its receive has begun, so a send posted on its own "
     "after one action and the receive of the next wait for each other across neighbours. Post the send after an "
     "action and the receive the next action needs as one lablib.exchange(sends=[...], recvs=[...]) (Megatron-LM's "
     "send_forward_recv_backward), and wait on it before the next action."),
    ("timed out", "a rank waited for a message that never came: the two sides of a message must agree on the "
                  "peer (stage s is on rank s % world_size) and on the order (messages between two ranks match "
                  "in the order posted)."),
    ("needs the activations", "receive the activations from the stage before into stage.buffer() (with the "
                              "exchange after the action before, or lablib.irecv(...).wait()) and pass them to stage.forward."),
    ("needs the gradient", "receive the gradient from the stage after into stage.buffer() and pass it to "
                           "stage.backward."),
    ("before its B", "with W actions in the schedule, B must be stage.backward(mb, grad, weights=False)."),
)


def given_plans(world_size, seed) -> dict:
    """{schedule: per rank its actions as lists}: lablib's schedules the executor runs, for ``world_size``."""
    schedules = answers("lab05").SCHEDULES
    return {name: [[list(a) for a in row] for row in schedules[name](world_size, ref.M, v)] for name, v in ref.CHECKED}


def collect_execute(fns, pool, seed, plans):
    share = ref.shares(pool.world_size, seed)  # each rank its stages' blocks, inputs and targets only
    return run_on_ranks(pool, "Task 5.4", ref.execute_job, fns[0], plans, share, seed is None, hints=_HINTS)


def _reference(seed):
    model = pp.model(ref.WIDTH, seed=seed or 0)
    xs, ys = pp.data(ref.WIDTH, ref.ROWS, ref.M, seed or 0)
    loss = sum(pp.loss_fn(model(x), y, ref.M) for x, y in zip(xs, ys))
    loss.backward()
    per = [[p.grad for p in block.parameters()] for block in model]
    return per


def judge_execute(data, world_size, seed) -> str:
    task, p = "Task 5.4", world_size
    if not isinstance(data, list) or len(data) != p:
        raise CheckFailed(f"{task}: expected one result per rank from {p} ranks.")
    blocks = _reference(seed)
    worst = vs_torch = 0.0
    for name, v in ref.CHECKED:
        n = p * v
        per = len(blocks) // n
        act_bytes = ref.ROWS // ref.M * ref.WIDTH * 4
        for r, got in enumerate(data):
            res = got.get(name) if isinstance(got, dict) else None
            if not isinstance(res, dict):
                raise CheckFailed(f"{task}: rank {r} returned no result for {name}.")
            if res["left"]:
                raise CheckFailed(f"{task}: after {name} on {p} ranks, rank {r}'s " + ", ".join(res["left"][:3]) +
                                  ": a backward (or W) did not run.")
            plan = answers("lab05").SCHEDULES[name](p, ref.M, v)[r]
            split = any(a.kind == "W" for a in plan)
            want_ran = [f"{'BW' if a.kind == 'B' and not split else a.kind}{a.mb}/{a.stage}" for a in plan]
            ran = [str(x) for x in res.get("ran", [])]
            if ran != want_ran:
                k = next((i for i, (a, b) in enumerate(zip(ran, want_ran)) if a != b), min(len(ran), len(want_ran)))
                got = ran[k] if k < len(ran) else "nothing more"
                raise CheckFailed(f"{task}: on {name}, rank {r}'s action {k} is {want_ran[k] if k < len(want_ran) else 'none'}"
                                  f" (kind micro-batch/stage; BW: a whole backward), but it ran {got}. Run the "
                                  "actions in the order given: the order is the schedule.")
            sends = sum(1 for a in plan if (a.kind == "F" and a.stage < n - 1) or (a.kind == "B" and a.stage > 0))
            recvs = sum(1 for a in plan if (a.kind == "F" and a.stage > 0) or (a.kind == "B" and a.stage < n - 1))
            ops = [str(o).split(" ") for o in res["ops"]]
            kinds = [o[0] for o in ops]
            if kinds.count("send") != sends or kinds.count("recv") != recvs or len(kinds) != sends + recvs:
                raise CheckFailed(f"{task}: on {name}, rank {r} issued {kinds.count('send')} sends and {kinds.count('recv')} "
                                  f"receives{' and other collectives' if len(kinds) != kinds.count('send') + kinds.count('recv') else ''}; "
                                  f"its actions need {sends} and {recvs}: an F receives from the stage before unless "
                                  "its stage is the first, and sends on unless it is the last; a B the other way.")
            unwaited = res.get("unwaited") or []
            if unwaited:
                kinds_left = {k: unwaited.count(k) for k in ("send", "recv") if k in unwaited}
                raise CheckFailed(f"{task}: on {name}, rank {r} never waited for " + " and ".join(
                    f"{c} of its i{k}s' handles" for k, c in kinds_left.items()) + ". "
                    + ("An irecv's buffer holds the message only once its handle's wait() returned: wait before "
                       "stage.forward or stage.backward reads it. " if "recv" in kinds_left else "")
                    + ("An isend's buffer may be read until its handle completes (NCCL reads it on the GPU later): "
                       "keep the handles and wait for them all after the last action." if "send" in kinds_left else ""))
            if any(int(o[-1]) != act_bytes for o in ops):
                raise CheckFailed(f"{task}: on {name}, rank {r} sent or received a message of another size than one "
                                  f"micro-batch's activations ({act_bytes} bytes).")
            if sorted(res["grads"]) != sorted(str(s) for s in range(r, n, p)):
                raise CheckFailed(f"{task}: on {name}, rank {r} returned the gradients of stages "
                                  f"{', '.join(sorted(res['grads']))}; it holds {', '.join(str(s) for s in range(r, n, p))}.")
            for s, grads in res["grads"].items():
                s = int(s)
                want = [g for b in blocks[s * per:(s + 1) * per] for g in b]
                if len(grads) != len(want):
                    raise CheckFailed(f"{task}: on {name}, stage {s} returned {len(grads)} gradients; it has {len(want)} "
                                      "parameters.")
                for k, (g, w) in enumerate(zip(grads, want)):
                    if g is None:
                        raise CheckFailed(f"{task}: on {name}, stage {s} (rank {r}) has no gradient for its parameter {k}: "
                                          "did every B (and W) run?")
                    err = max_error(g, w, f"{task}: on {name}, stage {s}'s gradient {k} (rank {r})")
                    if not err <= 1e-5:
                        wild = not err < 1e3  # nan, or far beyond what a wrong micro-batch gives
                        raise CheckFailed(f"{task}: on {name} with {p} ranks, stage {s}'s gradients (rank {r}) differ from "
                                          f"one process's by {err:.2e}. Each micro-batch must go through every stage once, "
                                          "forward then backward, with the activations and gradients received for it "
                                          "(messages between two ranks match in the order posted)." + (
                                              " A difference this large usually means a buffer was read before its "
                                              "message arrived (or never written): take stage.buffer()'s tensor only "
                                              "after its irecv's wait() returned." if wild else ""))
                    worst = max(worst, err)
                    if res["torch"] is not None:
                        t = res["torch"][str(s)][k]
                        vs_torch = max(vs_torch, max_error(t, g, f"{task}: pipelining's gradient {k} of stage {s}"))
    return (f" on {p} ranks: GPipe, 1F1B, interleaved 1F1B (v=2) and ZB-H1 give one process's gradients (max error "
            f"{worst:.1e})" + (f" and torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, "
                               f"ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble's (max difference {vs_torch:.1e})"
                               if seed is None else ""))


check_execute = Check("Task 5.4", ("execute",), collect_execute, judge_execute, world_sizes=(2, 4),
                      forbidden=FORBIDDEN, every_size=True, given=given_plans)
"""Task 5.4: any valid schedule run on real ranks."""


# -- the notebook's measurements run the learner's functions once they have passed ----------------------------
_TASKS = {"gpipe": ("Task 5.1", "gpipe"), "one_f_one_b": ("Task 5.1", "1f1b"),
          "interleaved": ("Task 5.2", "interleaved"), "zb_h1": ("Task 5.2", "zb-h1"), "validate": ("Task 5.3", "validate"),
          "execute": ("Task 5.4", "execute")}


def yours(**fns) -> dict:
    """{"gpipe": fn, "1f1b": fn, "interleaved": fn, "zb-h1": fn, "validate": fn, "execute": fn}: each of the learner's functions whose task's check passed in this
    kernel, lablib's for the others. Prints whose are used."""
    from . import whose

    mine = whose(fns, {k: task for k, (task, _) in _TASKS.items()}, "Running")
    sc = answers("lab05")
    out = {"execute": sc.execute, **{k: (lambda f: lambda p, m, v=1: f(p, m))(f) for k, f in
                                     (("gpipe", sc.gpipe), ("1f1b", sc.one_f_one_b), ("zb-h1", sc.zb_h1))},
           "interleaved": sc.interleaved, "validate": sc.validate}
    for k in mine:
        fn = fns[k]
        out[_TASKS[k][1]] = fn if k in ("execute", "interleaved", "validate") else (lambda f: lambda p, m, v=1: f(p, m))(fn)
    return out
