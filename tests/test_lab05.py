"""Lab 05 (pipeline bubbles): lablib's schedules against the papers' bubbles and memory, the validator's
rules, the Stage's split backward and its activation count, the executor against one process and
torch.distributed.pipelining, the measured breakdown; Tasks 5.1-5.4's checks on right answers and
typical mistakes."""
import ast
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import lablib
from lablib.checks import PASSED, CheckFailed
from lablib.checks.lab05 import (_bank, check_advanced, check_execute, check_simple, check_validate, judge_execute,
                                 yours)
from lablib.answers import lab05 as answers
from lablib.checks.lab05 import given_plans
from lablib.strategies import pipeline as pp
from lablib.strategies import schedules as sc
from lablib.strategies import pp_reference as ref


# -- a learner's answers (defined here: checks refuse lablib's own functions) ------------------------------
def gpipe(p, m):
    return [[("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)] for r in range(p)]


def one_f_one_b(p, m):
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            acts += [("F", warm + i, r), ("B", i, r)]
        out.append(acts + [("B", i, r) for i in range(m - warm, m)])
    return out


def interleaved(p, m, v):
    def action(kind, k, r, stage_of):
        return (kind, (k // (p * v)) * p + k % p, r + p * stage_of(k))

    out = []
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * p, v * m)
        fwd = [action("F", k, r, lambda k: (k // p) % v) for k in range(v * m)]
        bwd = [action("B", k, r, lambda k: v - 1 - (k // p) % v) for k in range(v * m)]
        acts = fwd[:warm]
        for k in range(v * m - warm):
            acts += [fwd[warm + k], bwd[k]]
        out.append(acts + bwd[v * m - warm:])
    return out


def zb_h1(p, m):
    out = []
    for r, row in enumerate(one_f_one_b(p, m)):
        acts, backs = [], 0
        for a in row:
            acts.append(a)
            if a[0] == "B":
                if backs >= r:
                    acts.append(("W", backs - r, r))
                backs += 1
        out.append(acts + [("W", i, r) for i in range(max(0, m - r), m)])
    return out


def validate(schedule, m, v=1):
    p, stages = len(schedule), len(schedule) * v
    for r, row in enumerate(schedule):
        for i, (kind, mb, s) in enumerate(row):
            if not 0 <= s < stages or s % p != r or not 0 <= mb < m:
                return (r, i, "not on this rank")
    seen = set()
    for r, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a in seen:
                return (r, i, "twice")
            seen.add(a)
    kinds = "FBW" if any(a[0] == "W" for row in schedule for a in row) else "FB"
    for r in range(p):
        for s in range(r, stages, p):
            for mb in range(m):
                for kind in kinds:
                    if (kind, mb, s) not in seen:
                        return (r, len(schedule[r]), "missing")

    def needs(kind, mb, s):
        if kind == "F":
            return [("F", mb, s - 1)] if s > 0 else []
        if kind == "B":
            return [("F", mb, s)] + ([("B", mb, s + 1)] if s < stages - 1 else [])
        return [("B", mb, s)]

    done, pos, moved = set(), [0] * p, True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(schedule[r]) and all(n in done for n in needs(*schedule[r][pos[r]])):
                done.add(schedule[r][pos[r]])
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(schedule[r])]
    return (stuck[0], pos[stuck[0]], "deadlock") if stuck else None


def execute(stages, actions):
    _execute(stages, actions)


def _execute(stages, actions, wrap=True, grouped=True, blocking=False, wait_recvs=True, wait_sends=True):
    """A second executor, with mistakes to choose: ``grouped=False`` posts each send on its own after its action and
    each receive before its action (fine on Gloo, a deadlock under NCCL's rules); ``grouped="pairs"`` sends with
    the next action's receive only, also when an F lies between two B's (the interleaved schedule deadlocks);
    ``blocking``: blocking sends; ``wrap=False``: activations to rank s + 1, not (s + 1) % world_size;
    ``wait_recvs``/``wait_sends=False``: the handles of receives or of sends are never waited for."""
    n = torch.distributed.get_world_size()
    acts = [tuple(a) for a in actions]
    split = any(kind == "W" for kind, _, _ in acts)
    src = [(s - 1) % n if k == "F" and not stages[s].first else (s + 1) % n if k == "B" and not stages[s].last else None
           for k, _, s in acts]
    dst = [((s + 1) % n if wrap else s + 1) if k == "F" and not stages[s].last else (s - 1) % n
           if k == "B" and not stages[s].first else None for k, _, s in acts]
    later = [grouped is True and len(stages) > 1 and dst[i] is not None and 0 < i < len(acts) - 1 and k == "F"
             and acts[i - 1][0] == "B" and acts[i + 1][0] == "B" and dst[i + 1] is not None
             for i, (k, _, _) in enumerate(acts)]
    inbox, carried, sends = {}, [], []
    for i, (kind, mb, s) in enumerate(acts):
        stage, x = stages[s], None
        if src[i] is not None:
            x, work = inbox.pop(i) if i in inbox else (lambda b: (b, lablib.irecv(b, src[i])))(stage.buffer())
            if wait_recvs:
                work.wait()
        if kind == "W":
            stage.backward_weight(mb)
            continue
        y = stage.forward(mb, x) if kind == "F" else stage.backward(mb, x, weights=not split)
        if dst[i] is None:
            continue
        if blocking:
            lablib.send(y, dst[i])
            continue
        if not grouped:
            sends.append(lablib.isend(y, dst[i]))
            continue
        carried.append((y, dst[i]))
        if later[i]:
            continue
        recvs, into = [], []
        for j in range(i + 1, len(acts)):
            if src[j] is not None:
                recvs.append((stages[acts[j][2]].buffer(), src[j]))
                into.append(j)
            if grouped == "pairs" or ((src[j] is not None or dst[j] is not None) and not later[j]):
                break
        work = lablib.exchange(sends=carried, recvs=recvs)
        inbox.update({j: (buf, work) for j, (buf, _) in zip(into, recvs)})
        carried = []
        if not recvs:
            sends.append(work)
    for work in sends if wait_sends else ():
        work.wait()


# -- typical mistakes ---------------------------------------------------------------------------------------
def one_f_one_b_too_warm(p, m):
    out = []
    for r in range(p):
        warm = min(p - r, m)
        acts = [("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            acts += [("F", warm + i, r), ("B", i, r)]
        out.append(acts + [("B", i, r) for i in range(m - warm, m)])
    return out


def gpipe_interleaving(p, m):
    return [[a for i in range(m) for a in (("F", i, r), ("B", i, r))] for r in range(p)]


def zb_w_at_once(p, m):
    out = []
    for row in one_f_one_b(p, m):
        acts = []
        for a in row:
            acts.append(a)
            if a[0] == "B":
                acts.append(("W", a[1], a[2]))
        out.append(acts)
    return out


def interleaved_blocks(p, m, v):
    # stages in contiguous blocks per rank (rank r holds r*v .. r*v+v-1): not where stage s lives
    return [[(k, mb, r * v + (s - r) // p) for k, mb, s in row] for r, row in enumerate(interleaved(p, m, v))]


def validate_always_fine(schedule, m, v=1):
    return None


def validate_twice_first(schedule, m, v=1):
    """Rules 1 and 2 swapped: looks for an action listed twice before one that cannot be on its rank."""
    p, stages, seen = len(schedule), len(schedule) * v, set()
    for r, row in enumerate(schedule):
        for i, a in enumerate(row):
            if a in seen:
                return (r, i, "twice")
            seen.add(a)
    for r, row in enumerate(schedule):
        for i, (kind, mb, s) in enumerate(row):
            if not 0 <= s < stages or s % p != r or not 0 <= mb < m:
                return (r, i, "not on this rank")
    return validate(schedule, m, v)


def execute_ungrouped(stages, actions):
    """Each send posted on its own after its action, each receive before its action: 1F1B's rank 0 sends F1
    while rank 1 sends B0, and under NCCL each send waits for the other's receive."""
    _execute(stages, actions, grouped=False)


def execute_pairs(stages, actions):
    """Each send with the next action's receive only: right for 1F1B, a deadlock in the interleaved schedule."""
    _execute(stages, actions, grouped="pairs")


def execute_unwrapped(stages, actions):
    """Sends activations to rank s + 1: past the last rank when the stages wrap around (interleaved)."""
    _execute(stages, actions, wrap=False)


def execute_blocking_send(stages, actions):
    """Blocking sends: 1F1B's rank 0 sends F1 while rank 1 sends B0, each waiting for the other to receive."""
    _execute(stages, actions, blocking=True)


def execute_never_waits_sends(stages, actions):
    """Drops the handles of the sends that go without a receive: the buffers may be read after the step."""
    _execute(stages, actions, wait_sends=False)


def execute_never_waits_recvs(stages, actions):
    """Computes on a receive buffer without waiting for its message."""
    _execute(stages, actions, wait_recvs=False, wait_sends=False)


def execute_full_backward(stages, actions):
    """Ignores W: every B computes the weights' gradient too, then W finds nothing to do."""
    execute(stages, [a for a in actions if a[0] != "W"])
    for kind, mb, s in actions:
        if kind == "W":
            stages[s].backward_weight(mb)


def not_done(*args):
    raise NotImplementedError("Task 5.x")


# -- lablib's schedules ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
def test_lablibs_schedules_leave_the_papers_bubble_and_hold_the_papers_memory(p, m):
    unit = {"F": 1, "BW": 2, "B": 1, "W": 1}
    for name in ("gpipe", "1f1b"):
        acts = answers.SCHEDULES[name](p, m)
        assert answers.validate(acts, m) is None
        assert sc.bubble(sc.simulate(acts, unit)) == pytest.approx(sc.theory(name, p, m))
    assert sc.in_flight(answers.gpipe(p, m)) == [m] * p
    assert sc.in_flight(answers.one_f_one_b(p, m)) == [min(m, p - r) for r in range(p)]
    zb = answers.zb_h1(p, m)
    assert answers.validate(zb, m) is None and max(sc.in_flight(zb)) <= p
    if m >= p:  # the paper's formula assumes the pipeline fills
        assert sc.bubble(sc.simulate(zb, unit)) == pytest.approx(sc.theory("zb-h1", p, m))
        assert sc.bubble(sc.simulate(zb, unit)) < sc.theory("1f1b", p, m)
    if m % p == 0:
        for v in (2, 3):
            acts = answers.interleaved(p, m, v)
            assert answers.validate(acts, m, v) is None
            times = {k: t / v for k, t in unit.items()}
            assert sc.bubble(sc.simulate(acts, times, v)) == pytest.approx(sc.theory("interleaved", p, m, v))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_rule_5_replays_the_executors_exchanges_under_nccls_rules(p):
    """Rule 5 replays the executor's exchanges with NCCL's rules: lablib's schedules pass, and a schedule valid
    by the data's rules can still stall there."""
    for m in (p, 2 * p):
        for schedule, v in ((answers.gpipe(p, m), 1), (answers.one_f_one_b(p, m), 1), (answers.zb_h1(p, m), 1),
                            (answers.interleaved(p, m, 2), 2)):
            assert answers.validate(schedule, m, v) is None
            assert sc.message_deadlock(sc.as_actions(schedule), v) is None
    if p == 2:  # valid by rules 1-4 (rank 1 swaps two actions), but its exchanges wait for each other: on the
        # ranks in strict mode, rank 1 waits to send to rank 0, which waits to send to rank 1
        schedule = answers.interleaved(2, 4, 2)
        schedule[1][8], schedule[1][9] = schedule[1][9], schedule[1][8]
        assert answers.deadlock(sc.as_actions(schedule), 4, 2) is None
        problem = answers.validate(schedule, 4, 2)
        assert (problem.rank, problem.index) == (0, 8) and "under NCCL's rules they wait for each other" in problem.reason


def _run_plan(plan, v):
    r, p = dist.get_rank(), dist.get_world_size()
    stages = pp.stages_of(r, p, v, list(pp.model(ref.WIDTH, seed=0)), *pp.data(ref.WIDTH, ref.ROWS, 4, 0))
    answers.execute(stages, plan[r])


def test_what_rule_5_calls_a_stall_stalls_on_the_ranks_in_strict_mode(fragile):
    from lablib import p2p

    if fragile.world_size != 2:
        pytest.skip("the schedule is for 2 ranks")
    schedule = answers.interleaved(2, 4, 2)
    fragile.run(p2p.strictly(_run_plan), schedule, 2)
    schedule[1][8], schedule[1][9] = schedule[1][9], schedule[1][8]
    with pytest.raises(lablib.RankError, match=r"\(NCCL's rules\): rank \d waits to send to rank \d"):
        fragile.run(p2p.strictly(_run_plan), schedule, 2)


def test_rule_5_names_messages_that_meet_the_wrong_receive():
    """Without tags, messages between two ranks match in the order posted: a rank that runs B1 before B0
    while the stage after sends B0's gradient first would take one for the other (same shape: no error)."""
    g = [list(row) for row in answers.gpipe(2, 2)]
    g[0][2], g[0][3] = g[0][3], g[0][2]  # rank 0: F0 F1 B1 B0, rank 1 sends B0 first
    assert answers.deadlock(sc.as_actions(g), 2, 1) is None  # the data's order is fine
    problem = answers.validate(g, 2, 1)
    assert problem.rank == 0 and problem.index == 2 and "match in the order posted" in problem.reason


def test_the_validator_names_the_first_action_that_cannot_run():
    want = {"stage 0's forward listed on rank 1": (1, 1), "a backward listed twice": (0, 4),
            "a backward missing": (1, 3), "a deadlock: each rank waits for the other": (0, 1),
            "a backward before its own forward": (0, 2), "a W before its B": (0, 2),
            "a micro-batch out of range": (0, 1), "a micro-batch out of range, listed twice": (1, 1)}
    for schedule, m, v, what in _bank():
        problem = answers.validate(schedule, m, v)
        if what in want:
            assert problem is not None and (problem.rank, problem.index) == want[what], (what, problem)
            assert problem.reason
        else:
            assert problem is None, (what, problem)
    deadlock = _bank()[7][0]
    assert "can never start: it needs B0 of stage 1" in answers.validate(deadlock, 2).reason
    # the explanation goes to the root: rank 1's B0 waits for its own F0, listed after it
    own = answers.validate(_bank()[8][0], 2).reason
    assert own.endswith("it needs B0 of stage 1 (rank 1's action 0), which needs F0 of stage 1 (rank 1's action 1), "
                        "which rank 1 reaches only after B0 of stage 1, named above: a cycle, so none of these ever "
                        "starts"), own
    with pytest.raises(ValueError, match=r"the schedule\[0\]\[1\] is 'F0'"):
        answers.validate([[("F", 0, 0), "F0"]], 1)


def test_interleaved_needs_groups_of_p():
    with pytest.raises(ValueError, match="does not divide by p"):
        answers.interleaved(4, 6, 2)


# -- the Stage ------------------------------------------------------------------------------------------------------
def test_a_split_backward_gives_the_full_backwards_gradients_and_memory_is_counted():
    blocks = list(pp.model(seed=3))
    xs, ys = pp.data(32, 8, 2, seed=3)
    whole = pp.Stage(blocks, 0, 1, xs, ys)
    for mb in range(2):
        whole.forward(mb)
    assert whole.held.live == 2 * whole.per_mb > 0
    for mb in range(2):
        whole.backward(mb)
    assert whole.held.live == 0 and whole.held.peak == 2 * whole.per_mb
    full = [p.grad.clone() for b in blocks for p in b.parameters()]
    for b in blocks:
        b.zero_grad(set_to_none=True)
    split = pp.Stage(blocks, 0, 1, xs, ys)
    for mb in range(2):
        split.forward(mb)
        split.backward(mb, weights=False)
        assert all(p.grad is None for b in blocks for p in b.parameters())  # B leaves the weights to W
        assert 0 < split.held.live < split.per_mb * (mb + 1)                     # what W needs, less than the forward's
    for mb in range(2):
        split.backward_weight(mb)
    assert split.held.live == 0
    assert max((p.grad - f).abs().max().item() for p, f in zip((p for b in blocks for p in b.parameters()), full)) < 1e-6
    with pytest.raises(ValueError, match="before its B"):
        split.backward_weight(0)
    mid = pp.Stage(blocks[:4], 1, 2, xs, ys)
    with pytest.raises(ValueError, match="needs the activations received from stage 0"):
        mid.forward(0)


# -- on the ranks ---------------------------------------------------------------------------------------------------
def test_lablibs_executor_matches_one_process_and_torch_pipelining(cluster):
    n = cluster.world_size
    text = judge_execute(cluster.run(ref.execute_job, answers.execute, given_plans(n, None), ref.shares(n), True), n, None)
    assert "torch.distributed.pipelining" in text
    diff = float(text.split("max difference ")[1].split(")")[0])
    assert 0 <= diff <= 1e-5


def test_right_answers_pass_every_check(cluster, capsys):
    if cluster.world_size != 2:
        pytest.skip("the executor's check runs at 2 and 4 ranks: once is enough")
    check_simple(gpipe, one_f_one_b)
    check_advanced(interleaved, zb_h1)
    check_validate(validate)
    check_execute(execute, cluster)
    for seed in (1, 2):
        check_simple(gpipe, one_f_one_b, seed=seed)
        check_advanced(interleaved, zb_h1, seed=seed)
        check_validate(validate, seed=seed)
    out = capsys.readouterr().out
    assert "✓ Task 5.4 passed on 2 ranks" in out and "✓ Task 5.4 passed on 4 ranks" in out
    assert {"Task 5.1", "Task 5.2", "Task 5.3", "Task 5.4"} <= PASSED


@pytest.mark.parametrize("check, fns, message", [
    (check_simple, (gpipe, one_f_one_b_too_warm), r"one_f_one_b\(2, 4\) holds 3 micro-batches' activations on rank 0"),
    (check_simple, (gpipe_interleaving, one_f_one_b), r"gpipe\(2, 4\) on rank 0 runs F0 B0 F1 B1"),
    (check_advanced, (interleaved, zb_w_at_once), r"leaves a bubble of 0\.\d+ of the step; ZB-H1"),
    (check_advanced, (interleaved_blocks, zb_h1), r"cannot run: F0 of stage 1 is not on rank 0"),
    (check_advanced, (interleaved, one_f_one_b), "has no W actions"),
    (check_validate, (validate_always_fine,), "validate returned None for stage 0's forward listed on rank 1"),
    (check_validate, (validate_twice_first,), r"Yours is what rule 2 finds \(an action listed twice\), but rule 1 \(an "
                                              r"action that cannot be on its rank\) comes first"),
    (check_simple, (not_done, one_f_one_b), "Task 5.1 is not done yet"),
])
def test_mistakes_are_named(check, fns, message):
    with pytest.raises(CheckFailed, match=message):
        check(*fns)


def test_executor_mistakes_are_named(fragile):
    if fragile.world_size != 2:
        pytest.skip("one world size is enough")
    with pytest.raises(CheckFailed, match=r"(?s)Likely: a deadlock under NCCL's rules.*as one lablib.exchange.*"
                                          r"\(NCCL's rules\): rank \d waits to send to rank \d"):
        check_execute(execute_ungrouped, fragile, world_size=2, seed=1)
    with pytest.raises(CheckFailed, match=r"Likely: the interleaved schedule deadlocks under NCCL's rules.*An F between "
                                          "two B's sends with the B after it"):
        check_execute(execute_pairs, fragile, world_size=2, seed=1)
    with pytest.raises(CheckFailed, match="with W actions in the schedule, B must be"):
        check_execute(execute_full_backward, fragile, world_size=2, seed=1)
    with pytest.raises(CheckFailed) as err:
        check_execute(execute_blocking_send, fragile, world_size=2, seed=1)
    likely = str(err.value).split("\n")[0]
    assert "Likely: every rank is blocked in a send" in likely and "lablib.exchange" in likely and "tag" not in likely
    with pytest.raises(CheckFailed, match=r"rank 0 never waited for \d+ of its isends' handles\. An isend's buffer"):
        check_execute(execute_never_waits_sends, fragile, world_size=2, seed=1)
    with pytest.raises(CheckFailed, match=r"never waited for .*\d+ of its irecvs' handles\. An irecv's buffer holds"):
        check_execute(execute_never_waits_recvs, fragile, world_size=2, seed=1)


def _send_outside_the_world(dst_off, recv):
    n = torch.distributed.get_world_size()
    t0 = time.monotonic()
    try:
        (lablib.irecv if recv else lablib.isend)(torch.zeros(1), n - 1 + dst_off)
    except ValueError as err:
        return str(err), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_a_peer_outside_the_world_is_refused_at_once(fragile):
    n = fragile.world_size
    for off, recv, what in ((1, False, f"lablib.isend to rank {n}"), (-n, True, "lablib.irecv from rank -1")):
        for message, seconds in fragile.run(_send_outside_the_world, off, recv):
            assert f"{what}, but the world has {n} ranks" in message and "% world_size" in message, message
            assert seconds < 1  # not Gloo's wait for a rank that never joins
    if n == 2:
        with pytest.raises(CheckFailed, match=r"Likely: rank 1 sent to rank 2, but the world has 2 ranks: stage s runs "
                                              "on rank s % world_size"):
            check_execute(execute_unwrapped, fragile, world_size=2, seed=1)


def test_library_shortcuts_are_refused():
    def execute_with_dist(stages, actions):
        torch.distributed.send(stages[0].buffer(), 1)

    def execute_with_torch(stages, actions):
        return torch.distributed.pipelining.ScheduleGPipe(stages, 1)

    for fn, why in ((execute_with_dist, "lablib.exchange"), (execute_with_torch, "pipelining is what the lab compares")):
        with pytest.raises(CheckFailed, match=why):
            check_execute(fn, world_size=2, seed=1)
    with pytest.raises(CheckFailed, match="lablib's own"):
        check_simple(answers.gpipe, one_f_one_b)


def test_hidden_checks_draw_other_schedules_and_weights(cluster):
    n = cluster.world_size
    a, b = (cluster.run(ref.execute_job, answers.execute, given_plans(n, seed), ref.shares(n, seed), False)[0]["1f1b"]["grads"]["0"][0]
            for seed in (None, 5))
    assert (a - b).abs().max() > 1e-3
    with pytest.raises(CheckFailed):  # judged against another seed's reference, the same gradients fail
        judge_execute(cluster.run(ref.execute_job, answers.execute, given_plans(n, 5), ref.shares(n, 5), False), n, None)


# -- what the notebook measures ------------------------------------------------------------------------------------
def test_a_measured_run_splits_its_step_and_draws_its_messages(cluster):
    from lablib.views import pipeline as view

    fns = yours()
    run = view.measure(cluster, fns, "1f1b", 4, cost=0.002, repeats=1)
    assert run["step"] > 0 and run["busy"] + run["bubble"] + run["overhead"] == pytest.approx(1)
    assert 0 < run["bubble"] < 1 and run["busy"] > 0.3
    p = cluster.world_size
    assert [b / run["per_mb"] for b in run["peak"]] == [min(4, p - r) for r in range(p)]
    tl = run["timeline"]
    labels = {s.meta.get("label") for s in tl.spans if s.kind == "compute"}
    assert {"F0", "F3", "B0", "B3"} <= labels
    assert len(tl.messages()) == 2 * 4 * (p - 1)  # each micro-batch's activation and gradient across p-1 boundaries
    for send, recv in tl.messages():
        assert send.name.split()[-1] == recv.name.split()[-1] and recv.rank == send.meta["peer"]  # "send F3", "recv F3"
    assert view.plan_figure(answers.zb_h1(p, 4)).data and view.timelines([run, run]).data
    assert "1F1B" in view.table([run])


def test_yours_uses_a_learners_functions_only_once_their_check_passed(capsys):
    for task in ("Task 5.1", "Task 5.2", "Task 5.3", "Task 5.4"):
        PASSED.discard(task)
    fns = yours(gpipe=gpipe, execute=execute)
    assert fns["execute"] is answers.execute and fns["gpipe"](2, 2) == answers.gpipe(2, 2)
    PASSED.add("Task 5.4")
    fns = yours(gpipe=gpipe, execute=execute)
    assert fns["execute"] is execute
    assert "your functions of Task 5.4; lablib's for Task 5.1, Task 5.2, Task 5.3" in capsys.readouterr().out
    with pytest.raises(TypeError):
        yours(one_f_one_b_=one_f_one_b)
    PASSED.discard("Task 5.4")


@pytest.mark.parametrize("source, found", [
    ("def f(s, a):\n    torch.distributed.isend(s, 1)", "uses dist.isend"),
    ("def f(s, a):\n    dist.batch_isend_irecv([])", "uses dist.batch_isend_irecv"),
    ("from torch.distributed import pipelining as P\ndef f(s, a):\n    P.ScheduleGPipe(s, 1)", "pipelining"),
])
def test_ways_around_the_traced_messages_are_refused(source, found):
    from lablib.checks.lab05 import FORBIDDEN
    from lablib.rules.policy import problems

    assert any(found in p for p in problems(ast.parse(source), FORBIDDEN)), problems(ast.parse(source), FORBIDDEN)


# -- what a red team found ------------------------------------------------------------------------------------------
def execute_hiding_the_stages(stages, actions):
    """Moves empty messages of the right size (all in one exchange), computes nothing, and hides the stages from
    the check."""
    n = torch.distributed.get_world_size()
    sends, recvs = [], []
    for kind, mb, s in actions:
        st = stages[s]
        if kind == "F" and not st.first:
            recvs.append((st.buffer(), (s - 1) % n))
        if kind == "F" and not st.last:
            sends.append((st.buffer(), (s + 1) % n))
        if kind == "B" and not st.last:
            recvs.append((st.buffer(), (s + 1) % n))
        if kind == "B" and not st.first:
            sends.append((st.buffer(), (s - 1) % n))
    lablib.exchange(sends=sends, recvs=recvs).wait()
    stages.clear()


def execute_in_its_own_order(stages, actions):
    """Every forward first, then every backward (whole), whatever the schedule says."""
    forwards = [a for a in actions if a[0] == "F"]
    backwards = [("B", mb, s) for kind, mb, s in actions if kind == "B"]
    execute(stages, forwards + backwards)


def gpipe_as_1f1b_with_ws(p, m):
    return [[a for b in row for a in ((b, ("W", b[1], b[2])) if b[0] == "B" else (b,))] for row in one_f_one_b(p, m)]


def validate_sloppy(schedule, m, v=1):
    """One stage per rank assumed, micro-batches never range-checked: right on the plain schedules only."""
    return validate(schedule, 10 ** 6, 1) if v == 1 else None


def test_the_check_holds_its_own_references_to_the_stages(cluster):
    if cluster.world_size != 2:
        pytest.skip("one world size is enough")
    with pytest.raises(CheckFailed, match=r"on gpipe, rank 0's action 0 is F0/0 .* but it ran nothing more"):
        check_execute(execute_hiding_the_stages, cluster, world_size=2, seed=1)
    with pytest.raises(CheckFailed, match=r"on 1f1b, rank 0's action 2 is BW0/0 .* but it ran F2/0. Run the actions in "
                                          "the order given"):
        check_execute(execute_in_its_own_order, cluster, world_size=2, seed=1)


def test_a_judge_trusts_no_count_of_cases_from_the_box():
    from lablib.checks.lab05 import judge_advanced, judge_simple, judge_validate

    for judge in (judge_simple, judge_advanced, judge_validate):
        for seed in (None, 3):
            with pytest.raises(CheckFailed, match="not those of the"):
                judge([], None, seed)


def test_gpipe_is_all_forwards_then_all_backwards_and_hidden_validators_meet_interleaving():
    with pytest.raises(CheckFailed, match="GPipe runs every micro-batch's forward, then the backwards"):
        check_simple(gpipe_as_1f1b_with_ws, one_f_one_b)
    with pytest.raises(CheckFailed, match="Task 5.3"):
        check_validate(validate_sloppy, seed=1)


def test_exercise_code_can_make_tensors_in_a_fresh_grading_namespace():
    code = ("from lablib.rules.namespace import namespace\nns = namespace()\n"
            "exec(compile('x = torch.tensor([1, 2]).sum().item()', 'cell', 'exec'), ns)\nprint(ns['x'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr


@pytest.mark.parametrize("source", [
    "def f(x):\n    x.numpy().tofile('results.jsonl')",
    "def f(x):\n    return torch.from_file('request.json', size=10)",
    "def f(x):\n    return torch.UntypedStorage.from_file('request.json', False, 10)",
    "def f(x):\n    torch.profiler.profile().export_chrome_trace('x')",
    "def f(t):\n    t.save_chrome_trace('results.jsonl')",
])
def test_files_stay_out_of_reach_of_exercise_code(source):
    from lablib.checks.lab05 import FORBIDDEN
    from lablib.rules.policy import problems

    assert problems(ast.parse(source), FORBIDDEN), source


def test_a_rank_counts_the_activations_of_all_its_stages(cluster):
    from lablib.views import pipeline as view

    p = cluster.world_size
    run = view.measure(cluster, yours(), "interleaved", p, 2, cost=0.001, repeats=1)
    # v = 2 stages of half the layers each: half a micro-batch's activations per (micro-batch, stage) held
    assert [b / run["per_mb"] for b in run["peak"]] == [k / 2 for k in sc.in_flight(answers.interleaved(p, p, 2))]


def test_a_judge_checks_a_shape_before_it_computes_with_it(cluster):
    """A gradient returned as (500000, 1, 1) broadcasts against a (W, W) reference: the judge once took
    gigabytes of the grader's memory computing with it. It is refused by its shape, with no memory spent."""
    import resource

    data = cluster.run(ref.execute_job, answers.execute, given_plans(cluster.world_size, None), ref.shares(cluster.world_size),
                       False)
    name = ref.CHECKED[0][0]
    stage = sorted(data[0][name]["grads"])[0]
    data[0][name]["grads"][stage][0] = torch.zeros(500_000, 1, 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckFailed, match=r"gradient 0 \(rank 0\) has shape \(500000, 1, 1\), expected \(\d+, \d+\)"):
        judge_execute(data, cluster.world_size, None)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: the peak grew < 100 MB


def _reachable(obj, depth=3):
    """Every object reached from ``obj`` through public attributes and list/dict items (what exercise
    code may walk), ``depth`` steps deep."""
    seen, todo = {}, [(obj, 0)]
    while todo:
        item, d = todo.pop()
        if id(item) in seen or d > depth or isinstance(item, (torch.Tensor, torch.nn.Module, str, int, float)):
            continue
        seen[id(item)] = item
        if isinstance(item, (list, tuple)):
            todo += [(x, d + 1) for x in item]
        elif isinstance(item, dict):
            todo += [(x, d + 1) for x in item.values()]
        elif hasattr(item, "__dict__"):
            todo += [(v, d + 1) for k, v in vars(item).items() if not k.startswith("_")]
    return seen


def test_the_actions_a_rank_ran_are_out_of_the_executors_reach():
    """Task 5.4 judges the order of the actions each rank's stages ran: the executor holds the stages, so
    no public attribute of theirs may lead to that record (an executor once rewrote it to match)."""
    blocks = pp.model(ref.WIDTH, seed=0)
    xs, ys = pp.data(ref.WIDTH, ref.ROWS, ref.M, 0)
    stages = pp.stages_of(0, 1, 1, list(blocks), xs, ys)
    stage = stages[0]
    stage.forward(0)
    record = stage.rank_held._log
    assert record and not any(obj is record for obj in _reachable(stages).values())


def test_a_handle_counts_as_waited_once_it_says_it_completed_and_hands_out_nothing_else(cluster):
    def job():
        peer = (dist.get_rank() + 1) % dist.get_world_size()
        recv = lablib.irecv(torch.zeros(4), (dist.get_rank() - 1) % dist.get_world_size())
        send = lablib.isend(torch.ones(4), peer)
        while not recv.is_completed():
            pass
        send.wait()
        return recv.waited, hasattr(recv, "get_future"), hasattr(recv, "result")

    assert cluster.run(job) == [(True, False, False)] * cluster.world_size
