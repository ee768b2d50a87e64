"""The rank pool on real Gloo ranks: results, shipping by value, output, reuse, the shared pool."""
import os
import re

import pytest
import torch
import torch.distributed as dist
from procs import children

import lablib
from lablib import Cluster


def _rank_info(scale, offset=0):
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), x.item() * scale + offset


def test_results_come_back_in_rank_order(cluster):
    n = cluster.world_size
    out = cluster.run(_rank_info, 2.0, offset=1)
    assert out == [(r, n, n * (n + 1) / 2 * 2.0 + 1) for r in range(n)]


def test_tensors_come_back(cluster):
    out = cluster.run(lambda: torch.arange(3) * dist.get_rank())
    for r, t in enumerate(out):
        assert torch.equal(t, torch.arange(3) * r)


def test_notebook_function_with_globals_is_shipped_by_value(cluster):
    # A function defined in __main__ (as in a notebook) using a global of __main__: the children
    # cannot import it, so it must travel by value, globals included.
    ns = {"__name__": "__main__"}
    exec("SCALE = 7\ndef f(x):\n    return x * SCALE + __import__('torch.distributed').distributed.get_rank()\n", ns)
    assert ns["f"].__module__ == "__main__"
    assert cluster.run(ns["f"], 3) == [21 + r for r in range(cluster.world_size)]


def test_rank_output_is_prefixed_and_arrives_before_the_result(cluster, capsys):
    def talk():
        import sys
        print(f"hello from {dist.get_rank()}")
        print(f"warn {dist.get_rank()}", file=sys.stderr)
        print("no newline", end="")
        return dist.get_rank()

    cluster.run(talk)
    out, err = capsys.readouterr()
    for r in range(cluster.world_size):
        assert f"[rank {r}] hello from {r}\n" in out
        assert f"[rank {r}] no newline" in out
        assert f"[rank {r}] warn {r}\n" in err


def test_workers_and_process_group_are_reused(cluster):
    pids = cluster.pids()
    first = cluster.run(lambda: id(dist.group.WORLD))
    second = cluster.run(lambda: id(dist.group.WORLD))
    assert cluster.pids() == pids
    assert first == second


def test_each_rank_limits_its_threads(cluster):
    expected = max(1, os.cpu_count() // cluster.world_size)
    assert cluster.run(torch.get_num_threads) == [expected] * cluster.world_size


def test_unpicklable_argument_is_a_clear_error(cluster):
    import threading

    with pytest.raises(TypeError, match="could not send .* picklable"):
        cluster.run(lambda lock: None, threading.Lock())


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size="2"), "world_size must be an integer >= 1"),
    (dict(world_size=2, backend="mpi"), "unknown backend 'mpi'"),
    (dict(world_size=2, timeout=0), "timeout must be a positive"),
    (dict(world_size=2, threads=0), "threads must be an integer"),
])
def test_bad_arguments_fail_before_any_process_starts(kwargs, message):
    before = children()
    with pytest.raises(ValueError, match=message):
        Cluster(**kwargs)
    assert children() == before


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="needs fewer than 64 GPUs")
def test_nccl_with_too_few_gpus_is_a_clear_error():
    before = children()
    with pytest.raises(ValueError, match=r"backend='nccl' needs one GPU per rank: world_size=64"):
        Cluster(64, backend="nccl")
    assert children() == before


def test_auto_backend_follows_the_gpus():
    from lablib.pool import resolve_backend

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_backend("auto", 2) == ("nccl" if gpus >= 2 else "gloo")
    assert resolve_backend("auto", gpus + 1) == "gloo"


def test_constructor_says_which_backend_in_one_line(capsys):
    with Cluster(2, backend="gloo") as c:
        line = capsys.readouterr().out
        assert re.fullmatch(r"lablib: 2 rank\(s\), Gloo on CPU \(.*\), \d+ torch thread\(s\) per rank; ready in [\d.]+ s\n", line)
        assert c.run(lambda: 1) == [1, 1]
    with pytest.raises(RuntimeError, match="closed"):
        c.run(lambda: 1)


def test_shared_pool_is_reused_and_restarted_for_another_size():
    try:
        a = lablib.cluster(2, quiet=True)
        assert lablib.cluster(2) is a and lablib.cluster() is a
        b = lablib.cluster(3, quiet=True)
        assert b is not a and b.world_size == 3
        assert a._closed
        assert b.run(dist.get_world_size) == [3, 3, 3]
    finally:
        lablib.cluster().close()


def test_shared_pool_options_are_the_ones_asked_for_now():
    try:
        a = lablib.cluster(2, timeout=5, quiet=True)
        assert lablib.cluster() is a and a.timeout == 5  # no arguments: the pool as it is
        b = lablib.cluster(2, quiet=True)  # the default timeout again, not the earlier 5 s
        assert b is not a and b.timeout == 10.0
        assert lablib.cluster(2, debug=True) is b and b.debug
        assert lablib.cluster(2) is b and not b.debug
    finally:
        lablib.cluster().close()


def test_socket_folders_of_killed_notebooks_are_removed():
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Path(tempfile.gettempdir()) / f"lablib-{int(dead.stdout)}-left"
    stale.mkdir()
    (stale / "sock").write_text("")
    mine = Path(tempfile.mkdtemp(prefix=f"lablib-{os.getpid()}-"))  # a live process's folder stays
    try:
        with Cluster(2, backend="gloo", quiet=True):
            assert not stale.exists() and mine.exists()
    finally:
        mine.rmdir()


def test_one_spare_pool_is_kept_for_the_next_check_of_its_size():
    from lablib.pool import spare

    first = spare(1)
    assert spare(1) is first and first.run(_noop_job) == [None]  # the same size: no new start
    other = spare(2)
    assert first.closed and not other.closed  # another size closes it: one idle extra pool at most
    other.close()
    assert spare(2) is not other  # a closed one is replaced
    spare(2).close()


def _noop_job():
    return None


def _parent_pid():
    import os

    return os.getppid()


def test_ranks_fork_from_a_server_that_imported_torch_and_die_with_it():
    import os
    import signal

    from lablib.pool import zygote
    from procs import wait_gone

    if not zygote.usable():
        pytest.skip("ranks are forked only on Linux")
    with Cluster(2, quiet=True) as c:
        server = zygote.server()
        assert c.run(_parent_pid) == [server.proc.pid] * 2  # forked by the server, not started afresh
        pids = c.pids()
        os.kill(server.proc.pid, signal.SIGKILL)
        assert wait_gone(pids)  # PR_SET_PDEATHSIG: no rank outlives the server
    with Cluster(2, quiet=True) as c:  # a server that died is started again
        assert c.run(_parent_pid) == [zygote.server().proc.pid] * 2 != [server.proc.pid] * 2


def test_without_fork_ranks_start_from_scratch(monkeypatch):
    import os

    monkeypatch.setenv("LABLIB_FORK", "0")
    with Cluster(1, quiet=True) as c:
        assert c.run(_parent_pid) == [os.getpid()]


def test_a_rank_that_says_hello_before_its_start_returns_is_greeted(monkeypatch):
    """A forked rank is ready in milliseconds: on a busy machine it connected before the thread that
    started it had recorded it, was turned away and exited 0 ("rank 1 exited while starting"). The
    delay after each start makes that order certain."""
    import importlib
    import time

    cluster_module = importlib.import_module("lablib.pool.cluster")
    start = cluster_module.zygote.start

    def slow_start(*args, **kwargs):
        proc = start(*args, **kwargs)
        time.sleep(0.5)
        return proc

    monkeypatch.setattr(cluster_module.zygote, "start", slow_start)
    with Cluster(2, quiet=True) as c:
        assert c.run(lambda: dist.get_rank()) == [0, 1]


def _own(x, same):
    return x, same


@pytest.mark.parametrize("n", [2, 3])
def test_a_per_rank_argument_gives_each_rank_its_own_value(n):
    """A check's inputs reach each rank as its share (lablib.pool.PerRank): rank r's call gets the r-th value,
    shipped to it alone; the other arguments go to every rank as before."""
    from lablib.pool import PerRank
    from lablib.pool import protocol as P

    with Cluster(n, timeout=10, quiet=True) as c:
        got = c.run(_own, PerRank([torch.full((2,), float(r)) for r in range(n)]), "every rank")
        assert [(x.tolist(), s) for x, s in got] == [([float(r)] * 2, "every rank") for r in range(n)]
        with pytest.raises(TypeError, match=f"a PerRank argument holds 1 values for {n} ranks"):
            c.run(_own, PerRank([0]), None)
    args, kwargs = P.for_rank((PerRank(["a", "b"]), "c"), {"k": PerRank([1, 2])}, 1, 2)
    assert args == ("b", "c") and kwargs == {"k": 2}
