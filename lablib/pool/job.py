"""One job in flight, as the parent sees it: which ranks are done, what they returned or why they
failed, when to stop the ranks still running, and the stop button while it runs."""
from __future__ import annotations

import linecache
import os
import signal
import sys
import threading
import time

from . import protocol as P
from .failures import RankError, category, failure_message, signal_name

STOP_GRACE = 0.2      # after a rank fails, how long the others get to fail on their own (lost peer)
KILL_GRACE = 0.6      # after SIGINT, how long a rank gets to stop before SIGKILL
LATE_GRACE = 0.75     # past the collective timeout, so a blocked collective reports its own timeout first
LOST = object()       # event: a rank's connection closed (it exited or was killed)


# C-level lines a rank prints that mean nothing to a learner: torch.profiler's start/stop; torch 2.8's Gloo
# saying it connected ("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number ...") for each new group
_NOISE = ("USDT:", "[Gloo] Rank ")
# and, anywhere in a line: a CUDA build of torch on a machine without a GPU, whose profiler (Kineto) says it
# found none at each start (`lablib doctor` says once what that build costs and how to take the CPU one)
_NOISE_IN = ("gpuGetDeviceCount failed",)


# and a C++ abort's own lines (Gloo's "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
# "  what(): ... Received data size doesn't match expected size"): kept as the rank's last words, which the
# report of its death quotes, not printed as they come as well
_LAST_WORDS_ONLY = ("terminate called after throwing", "  what():")


def heard(w, stream: str, text: str) -> bool:
    """A line rank ``w`` printed: kept among its last words (stderr), and whether to print it in the cell now."""
    if noise(text):
        return False
    if stream == "stderr" and text.strip() and not text.startswith("[W"):  # c10d warnings are noise here
        w.last_words.append(text.strip())
    return not (stream == "stderr" and text.startswith(_LAST_WORDS_ONLY))


def noise(text: str) -> bool:
    """Whether a line a rank printed is noise to a learner (``_NOISE``)."""
    return text.startswith(_NOISE) or any(part in text for part in _NOISE_IN)


def print_output(rank, out: P.Out):
    """A rank's output in the cell, each line prefixed with the rank."""
    stream = sys.stderr if out.stream == "stderr" else sys.stdout
    stream.write("".join(f"[rank {rank}] {line}" for line in out.text.splitlines(keepends=True)))
    stream.flush()


def cell_sources():
    """Source lines of notebook cells (not files on disk), so remote tracebacks can quote them."""
    return {f: e[2] for f, e in list(linecache.cache.items())
            if len(e) == 4 and e[2] and ("ipykernel" in f or f.startswith("<")) and not os.path.exists(f)}


def cell_names() -> dict[str, str]:
    """{file name IPython compiled a cell under: "Cell In[5]"}, as IPython names cells in tracebacks."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        names = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    except ImportError:
        return {}
    return {f: f"Cell In[{n}]" for f, n in names.items()}


class StopButton:
    """While a job runs, SIGINT (the stop button, Ctrl-C) is counted here rather than raised wherever
    the main thread happens to be: a KeyboardInterrupt raised inside a finalizer or a library's
    ``except`` is lost, and with it the stop button, leaving the cell waiting on ranks that run on.
    The job's loop reads the count; ``Cluster._collect`` raises KeyboardInterrupt once the ranks are
    stopped."""

    def __init__(self):
        self.presses, self._installed, self._previous = 0, False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._press)
            self._installed = True
        return self

    def _press(self, signum, frame):
        self.presses += 1

    def __exit__(self, *exc):
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)


class Job:
    """What the parent knows about the job in flight, and what it does about each event."""

    def __init__(self, pool, job_id: int):
        self.pool, self.job_id = pool, job_id
        self.pending = set(range(pool.world_size))
        self.results, self.failures, self.raw_spans, self.killed = {}, {}, {}, set()
        self.flights = {}  # rank -> its flight recorder's entries, read when the job failed
        self.first_ok = self.first_error = self.stop_sent = None
        self.interrupted, self.stop_reason = False, ""
        self.started = time.monotonic()

    def stop_pressed(self) -> bool:
        """First press: SIGINT to the ranks still running. Second: kill them. False: stop waiting."""
        if self.interrupted:
            for rank in self.pending:
                self.pool._kill(rank)
                self.killed.add(rank)
            self.pending.clear()
            return False
        self.interrupted, self.stop_reason = True, "interrupted"
        self.pool._interrupt(self.pending)
        self.stop_sent = time.monotonic()
        return True

    def on_event(self, w, msg):
        rank = w.rank
        if isinstance(msg, P.Out):
            print_output(rank, msg)
        elif isinstance(msg, P.Done) and msg.job_id == self.job_id and rank in self.pending:
            self.pending.discard(rank)
            self.raw_spans[rank] = msg.spans
            if msg.failure is None:
                self.results[rank] = msg.value
                self.first_ok = self.first_ok or time.monotonic()
                if not msg.pg_alive:
                    self.pool._gen += 1
            else:
                self.failures[rank] = msg.failure
                self.first_error = self.first_error or time.monotonic()
                if msg.failure.restart:  # its GPU took an error that only a new process is free of
                    self.pool._kill(rank)
                    self.killed.add(rank)
        elif msg is LOST and rank in self.pending and w is self.pool._workers.get(rank):
            w.proc.wait()
            for reader in w.readers:  # its pipes end with it: read to the end, for its last words
                reader.join(1.0)
            self.pending.discard(rank)
            self.killed.add(rank)
            said = "; its last output:\n    " + "\n    ".join(w.last_words) if w.last_words else ""
            self.failures[rank] = P.Failure("WorkerDied", f"rank {rank} died ({signal_name(w.proc.returncode)}){said}",
                                           time=time.perf_counter_ns())
            self.first_error = self.first_error or time.monotonic()

    def enforce_deadlines(self, now):
        """Stop the ranks still running once another failed or finished long ago; kill the deaf ones."""
        if self.pending and self.stop_sent is None:
            if self.first_error is not None and now - self.first_error > STOP_GRACE:
                self.stop_reason = "another rank failed"
            elif self.first_ok is not None and now - self.first_ok > self.pool.timeout + LATE_GRACE:
                self.stop_reason = f"still running {self.pool.timeout:g} s after rank {min(self.results)} finished"
            elif self.pool.job_limit is not None and now - self.started > self.pool.job_limit:
                self.stop_reason = f"the job ran past its time limit, job_limit={self.pool.job_limit:g} s"
            if self.stop_reason:
                self.pool._interrupt(self.pending)
                self.stop_sent = now
        if self.pending and self.stop_sent is not None and now - self.stop_sent > KILL_GRACE:
            for rank in self.pending:
                self.pool._kill(rank)
                self.killed.add(rank)
                self.failures.setdefault(rank, P.Failure(
                    "Stuck", "did not respond to SIGINT (stuck inside a C++ call, usually a collective waiting for "
                    "a peer); the process was killed and restarted", interrupted=True, time=time.perf_counter_ns()))
            self.pending.clear()

    def outcome(self) -> list:
        """The values in rank order, or RankError naming what failed where."""
        values = {}
        for rank, blob in self.results.items():
            try:
                values[rank] = P.unship(blob)
            except Exception as exc:
                self.failures[rank] = P.Failure(type(exc).__name__, f"its result could not be unpickled here: {exc}")
        if self.failures:
            ordered = [values.get(r) for r in range(self.pool.world_size)]
            message = failure_message(self.failures, set(values) - set(self.failures), self.stop_reason,
                                      self.pool.world_size, self.pool.timeout, cell_names(), self.flights)
            stopped = [r for r, f in self.failures.items() if category(f) in ("stopped", "Stuck")]
            raise RankError(message, self.failures, stopped, ordered, self.flights)
        return [values[r] for r in range(self.pool.world_size)]
