"""Nothing a rank does may hang the notebook: each failure comes back as a clear error, in bounded
time, and the pool runs the next job. The bounds asserted here separate "reported" from "hung"
(the Gloo default would be 30 minutes): a slow run on a busy machine must not break them.
benchmarks/bench_cluster.py measures the actual latencies (error <= 1 s, hang <= timeout + 2 s,
stop <= 2 s)."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from procs import HUNG, alive, wait_gone

import lablib
from lablib import RankError


def _healthy(c):
    def f():
        x = torch.ones(2)
        dist.all_reduce(x)
        return x[0].item()

    assert c.run(f) == [float(c.world_size)] * c.world_size


def _raise_on_last():
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("bad shard size 3")
    x = torch.ones(4)
    dist.all_reduce(x)  # the others are inside a collective with the failing rank


def test_exception_names_the_rank_and_carries_its_traceback(fragile):
    last = fragile.world_size - 1
    t = time.perf_counter()
    with pytest.raises(RankError) as info:
        fragile.run(_raise_on_last)
    assert time.perf_counter() - t < HUNG
    err = info.value
    msg = str(err)
    assert msg.startswith(f"rank {last} of {fragile.world_size} failed: ValueError: bad shard size 3")
    assert "in _raise_on_last" in msg and 'raise ValueError("bad shard size 3")' in msg
    assert isinstance(err.exception(last), ValueError)
    assert last in err.ranks
    _healthy(fragile)


def _a_kernel_asserts_on_rank_1():
    if dist.get_rank() == 1:  # what torch raises once a kernel's index check failed on a GPU
        raise RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call, so the stacktrace below might be incorrect.")
    return os.getpid()


def test_a_rank_whose_gpu_took_a_sticky_error_is_restarted(fragile):
    """After a device-side assert every call on that GPU fails, so the rank is restarted (a new process) and the
    report says why; the next job runs on every rank."""
    before = fragile.run(os.getpid)
    with pytest.raises(RankError) as info:
        fragile.run(_a_kernel_asserts_on_rank_1)
    msg = str(info.value)
    assert msg.startswith(f"rank 1 of {fragile.world_size} failed: RuntimeError: CUDA error: device-side assert")
    assert "Hint: rank(s) 1 took a CUDA error that stays with the process" in msg and "IndexError" in msg, msg
    after = fragile.run(os.getpid)
    assert after[1] != before[1] and [a == b for a, b in zip(after, before)].count(False) == 1, (before, after)
    _healthy(fragile)


def _prepared_then_fails():
    from lablib import p2p

    p2p._PREPARED.add(None)  # as p2p.prepare() leaves the world group under NCCL
    raise ValueError("failed after its first exchange")


def _prepared():
    from lablib import p2p

    return sorted(map(str, p2p._PREPARED))


def test_a_group_made_again_after_a_failure_is_prepared_again(fragile):
    """Under NCCL a group's first batch_isend_irecv needs every rank, so p2p.prepare makes its communicator with a
    collective once per group; after a failure the world group is made again (still None), and must be again."""
    with pytest.raises(RankError):
        fragile.run(_prepared_then_fails)
    assert fragile.run(_prepared) == [[]] * fragile.world_size


def _skip_collective():
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(3))


def _different_collectives():
    x = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, src=0)


def _debug_level():  # not dist.get_debug_level itself: a pybind builtin cloudpickle cannot send on torch 2.8
    return dist.get_debug_level()


def _never_arrives():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(3))


# On a busy machine the ranks' timeouts fire at different moments: the first rank to time out closes
# its connections, and a peer still waiting then reports a lost peer instead of its own timeout, or is
# stopped by lablib before its own timeout fires. Either way the message must name the timeout and
# every rank with the collective it was in.
_IN = r"rank {r}(?: in|: left|: did not finish; stopped by lablib in) {op}"


@pytest.mark.parametrize("fn, expect", [
    (_skip_collective, [r"timed out after 2 s waiting for a peer: rank \d in all_reduce", _IN.format(r=1, op="all_reduce")]),
    (_different_collectives, [r"timed out after 2 s waiting for a peer", _IN.format(r=0, op="all_reduce"),
                              _IN.format(r=1, op="broadcast")]),
    (_never_arrives, [r"rank 1: did not finish; stopped by lablib"]),
])
def test_hang_is_reported_not_waited_out(fragile, fn, expect):
    t = time.perf_counter()
    with pytest.raises(RankError) as info:
        fragile.run(fn)
    assert time.perf_counter() - t < fragile.timeout + HUNG
    message = str(info.value)
    for pattern in expect:
        assert re.search(pattern, message), (pattern, message)
    assert "Hint: a collective waited 2 s" in message
    if fn is _never_arrives:  # where the stuck rank was, from its own traceback
        assert "--- rank 1 where it was stopped ---" in message
        assert "time.sleep(3600)" in message
        assert 1 in info.value.unfinished
    _healthy(fragile)


def _computes_for_a_long_time():
    time.sleep(3600)


def _skips_a_collective():
    lablib.all_reduce(torch.ones(4))
    if dist.get_rank() == 0:
        lablib.all_gather(torch.empty(4 * dist.get_world_size()), torch.ones(4))


def _reorders_two():
    first, second = (lambda: lablib.all_reduce(torch.ones(4))), (lambda: lablib.broadcast(torch.ones(2), 0))
    for call in (first, second) if dist.get_rank() == 0 else (second, first):
        call()


def test_a_hangs_report_says_what_each_rank_last_issued(fragile):
    """The flight recorder: each rank's last lablib calls of the job, in the report and as data; a rank
    that finished, or that Gloo aborted, as well as the stopped ones (the pool reads each rank's file)."""
    n = fragile.world_size
    with pytest.raises(RankError) as info:
        fragile.run(_skips_a_collective)
    assert f"rank 0: #1 all_reduce 16 B (float32 (4,)), #2 all_gather 16 B (float32 (4,))" in str(info.value)
    assert [e[:3] for e in info.value.flight(0)] == [(1, "all_reduce", 16), (2, "all_gather", 16)]
    assert [e[:3] for e in info.value.flight(1)] == [(1, "all_reduce", 16)]  # it finished after #1
    assert "rank 1: #1 all_reduce 16 B (float32 (4,))" in str(info.value)
    with pytest.raises(RankError) as info:
        fragile.run(_reorders_two)  # a new job: its records start again at #1
    assert [e[1] for e in info.value.flight(0)] == ["all_reduce"]
    assert all([e[1] for e in info.value.flight(r)] == ["broadcast"] for r in range(1, n))
    assert "rank 1: #1 broadcast 8 B" in str(info.value)
    assert fragile.run(lambda: 1) == [1] * n


def _mismatched_sizes():
    lablib.all_reduce(torch.ones(3 if dist.get_rank() == 0 else 4))


def test_the_flight_of_a_rank_gloo_aborted_is_read_too(fragile):
    """Gloo aborts a rank that receives more than its collective expects (SIGABRT: nothing is sent back):
    its flight recorder comes from the file it wrote before the call."""
    with pytest.raises(RankError) as info:
        fragile.run(_mismatched_sizes)
    for r in range(fragile.world_size):
        assert [e[1:3] for e in info.value.flight(r)] == [("all_reduce", 12 if r == 0 else 16)]
    assert "rank 0: #1 all_reduce 12 B (float32 (3,))" in str(info.value)
    assert fragile.run(lambda: 1) == [1] * fragile.world_size


def test_a_job_past_its_time_limit_is_stopped(fragile):
    fragile.job_limit = 1
    try:
        t = time.perf_counter()
        with pytest.raises(RankError, match=r"did not finish \(the job ran past its time limit, job_limit=1 s\)"):
            fragile.run(_computes_for_a_long_time)
        assert time.perf_counter() - t < HUNG
    finally:
        fragile.job_limit = None
    _healthy(fragile)


def _replaces_the_default_group():
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_world_size()


def test_a_replaced_default_group_is_restored_with_a_warning(fragile, capfd):
    assert fragile.run(_replaces_the_default_group) == [1] * fragile.world_size
    assert fragile.run(dist.get_world_size) == [fragile.world_size] * fragile.world_size
    assert "this job replaced the default process group (now 1 rank(s)" in capfd.readouterr().err


def _everyone_receives_first():
    import lablib

    t, peer = torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size()
    lablib.recv(t, peer)
    lablib.send(t, peer)


def _everyone_waits_on_an_irecv_first():
    import lablib

    t, peer = torch.zeros(1), (dist.get_rank() + 1) % dist.get_world_size()
    lablib.irecv(t, peer).wait()
    lablib.send(t, peer)


def _one_rank_skips_its_send():
    """A ring step written with isend/irecv, but rank 0 does not pass its chunk on: its right neighbour waits."""
    import lablib

    r, n = dist.get_rank(), dist.get_world_size()
    t, got = torch.zeros(1), torch.zeros(1)
    works = [lablib.irecv(got, (r - 1) % n)] + ([lablib.isend(t, (r + 1) % n)] if r else [])
    for w in works:
        w.wait()


@pytest.mark.parametrize("fn, op, hint", [
    (_everyone_receives_first, "recv", "Hint: every rank is blocked in recv"),
    # an irecv's handle is waited on in lablib's Work, not in torch.distributed: named irecv
    (_everyone_waits_on_an_irecv_first, "irecv", "or posted it only after waiting on one of its own"),
    (_one_rank_skips_its_send, "irecv", "its peer did not post the matching irecv/isend")])
def test_a_receive_deadlock_is_named_for_what_the_ranks_do(fragile, fn, op, hint):
    with pytest.raises(RankError) as info:
        fragile.run(fn)
    assert re.search(rf"waiting for a peer: rank \d in {op}\b", str(info.value)), str(info.value)
    assert hint in str(info.value), str(info.value)
    assert "a blocking send waits" not in str(info.value) or op == "recv"
    _healthy(fragile)


def test_a_rank_stuck_in_python_after_others_finish_is_stopped(fragile):
    def spin():
        if dist.get_rank() == 0:
            while True:
                pass

    t = time.perf_counter()
    with pytest.raises(RankError, match=r"rank\(s\) 0 of \d did not finish \(still running 2 s after rank 1 finished\)"):
        fragile.run(spin)
    assert time.perf_counter() - t < fragile.timeout + HUNG
    _healthy(fragile)


def test_debug_names_mismatched_collectives_at_once(fragile):
    fragile.debug = True
    try:
        t = time.perf_counter()
        with pytest.raises(RankError, match=r"Detected mismatch between collectives.*OpType=ALLREDUCE.*TensorShape=\[3\]"):
            fragile.run(_different_collectives)
        assert time.perf_counter() - t < HUNG  # the message says it was the check, not the timeout
        assert fragile.run(_debug_level) == [dist.DebugLevel.DETAIL] * fragile.world_size
    finally:
        fragile.debug = False
    assert fragile.run(_debug_level) == [dist.DebugLevel.OFF] * fragile.world_size
    _healthy(fragile)


def _press_stop():
    """What the stop button does, sent from inside the job (a timer in the test could fire before the
    job starts on a busy machine): SIGINT to the notebook process."""
    os.kill(int(os.environ["LABLIB_PARENT_PID"]), signal.SIGINT)


def _sleep_everywhere():
    if dist.get_rank() == 0:
        _press_stop()
    time.sleep(3600)


def _blocked_in_collective():
    if dist.get_rank() == 0:
        _press_stop()
        time.sleep(3600)  # interruptible
    dist.all_reduce(torch.ones(1))  # the others block inside Gloo, where SIGINT can't reach


@pytest.mark.parametrize("fn", [_sleep_everywhere, _blocked_in_collective])
def test_keyboard_interrupt_stops_every_rank(fragile, fn, capsys):
    t = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        fragile.run(fn)
    assert time.perf_counter() - t < HUNG
    assert "lablib: interrupted" in capsys.readouterr().err
    _healthy(fragile)


def test_a_stop_while_the_job_is_being_sent_still_stops_it(fragile, capsys):
    # SIGINT before the job reaches the ranks (here: from a pickling hook) must not be lost: the job
    # is stopped and the cell raises KeyboardInterrupt, instead of waiting on ranks that run on.
    class PressWhenShipped:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGINT)
            return (int, ())

    with pytest.raises(KeyboardInterrupt):
        fragile.run(lambda _: time.sleep(3600), PressWhenShipped())
    _healthy(fragile)


def test_a_rank_that_dies_is_reported_and_restarted(fragile):
    old = fragile.pids()

    def die():
        if dist.get_rank() == 0:
            os._exit(3)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankError, match=r"rank 0 of \d failed: rank 0 died \(exit code 3\)"):
        fragile.run(die)
    _healthy(fragile)
    new = fragile.pids()
    assert new[0] != old[0] and new[1:] == old[1:]


def test_a_dying_rank_s_last_words_are_in_the_error(fragile):
    def die_loudly():
        import sys
        if dist.get_rank() == 0:
            sys.__stderr__.write("fatal: the shard table is corrupt\n")  # as C++ code writes to fd 2
            sys.__stderr__.flush()
            os._exit(1)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankError, match=r"rank 0 died \(exit code 1\); its last output:\n    fatal: the shard table"):
        fragile.run(die_loudly)
    _healthy(fragile)


def test_size_mismatched_all_reduce_is_caught_not_silent(fragile):
    if fragile.world_size != 2:
        pytest.skip("Gloo's outcome depends on the sizes and the world size; on 2 ranks it aborts the receiver")

    def mismatch():
        dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 6))

    # Gloo's words for it: "Received data size doesn't match expected size" (torch >= 2.13), an
    # EnforceNotMet "op.preamble.length <= op.nbytes" (the older Gloo of torch 2.8)
    with pytest.raises(RankError, match="(?s)died \\(SIGABRT\\).*(Received data size doesn't match expected size"
                                        "|op\\.preamble\\.length <= op\\.nbytes)"):
        fragile.run(mismatch)
    _healthy(fragile)
    fragile.debug = True
    try:
        with pytest.raises(RankError, match=r"Detected mismatch between collectives.*TensorShape=\[(4|6)\]"):
            fragile.run(mismatch)
    finally:
        fragile.debug = False
    _healthy(fragile)


def _script(body):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, text=True)


def test_workers_exit_when_the_parent_is_killed():
    parent = _script("""
        import time, lablib
        c = lablib.Cluster(2, backend="gloo", quiet=True)
        print(*c.pids(), flush=True)
        time.sleep(3600)
    """)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:  # also when the line was not pids: a parent left sleeping would keep its workers
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert wait_gone(pids)


def test_two_pools_on_one_machine_do_not_clash():
    # Two "notebooks": two processes, each with its own pool, started at the same moment.
    body = """
        import lablib, torch, torch.distributed as dist
        def f():
            x = torch.ones(1) * (dist.get_rank() + 1)
            dist.all_reduce(x)
            return x.item()
        with lablib.Cluster(2, backend="gloo", quiet=True) as c:
            print(c.run(f), c._store.port)
    """
    procs = [_script(body) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split("]") for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all(o[0] == "[3.0, 3.0" for o in outs)
    assert outs[0][1] != outs[1][1]  # each hosts its own store, on a port the OS picked


def test_an_exception_whose_str_fails_is_still_reported(fragile):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    def raise_it():
        if dist.get_rank() == 0:
            raise Unprintable()
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankError, match=r"rank 0 of \d failed: Unprintable: <str\(\) of the Unprintable failed"):
        fragile.run(raise_it)
    _healthy(fragile)


def _not_done_on_last():
    if dist.get_rank() == dist.get_world_size() - 1:
        raise NotImplementedError("Task 9.9: write it")
    dist.all_reduce(torch.ones(4))  # the other ranks wait for it, and may be reported first


def test_a_check_says_not_done_whichever_rank_raised_it(fragile):
    from lablib.checks import NotDone, run_on_ranks

    with pytest.raises(NotDone, match=r"Task 9\.9 is not done yet: your code \(Task 9\.9: write it\)"):
        run_on_ranks(fragile, "Task 9.9", _not_done_on_last)
    _healthy(fragile)
