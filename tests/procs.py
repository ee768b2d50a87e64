"""Process helpers for the tests (Linux /proc), and the one time bound they use."""
import os

# A test's time bound only separates "finished" from "hung": a hang here would wait for Gloo's
# 30-minute process-group default or forever. A busy machine can make a 1 s failure take 10 s, so
# no test asserts anything tighter; benchmarks/bench_cluster.py measures the real latencies.
HUNG = 60.0


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds: float = HUNG) -> bool:
    """Wait until none of ``pids`` runs; True if they all went within ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def children() -> set[str]:
    """Direct child pids of this process."""
    pid = os.getpid()
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out |= set(f.read().split())
        except FileNotFoundError:  # the thread ended since the listing (a pool's reader, a timer)
            pass
    return out
