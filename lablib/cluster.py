"""A persistent pool of ranks: real processes running real ``torch.distributed`` code for a notebook.

    with Cluster(4) as cluster:
        cluster.run(fn, x)          # fn(x) on every rank, results in rank order
        cluster.timeline()          # what every rank did when, on one clock

Why a pool and not ``mp.spawn`` per cell: each new process pays ``import torch`` (1-3 s here, more
when 4 start at once on 2 cores); a pool pays it once and then runs a job in a few milliseconds.

How it stays out of the way of the learner:
- Workers are started with ``subprocess`` (spawn semantics: a kernel that has run a torch op hangs a
  forked child) and are reused; the process group is created once, and again only after a failure.
- Functions are shipped by value with cloudpickle (a notebook's ``__main__`` can't be imported by a
  child), so ``fn`` may be defined in the notebook and use its globals.
- Rendezvous goes through a TCPStore hosted here on a free port (rank 0 hosting it costs 300-700 ms
  of client back-off); two notebooks never clash on a port.
- A failure never hangs the cell: an exception on a rank comes back as ``RankError`` with the remote
  traceback; a rank that does not finish is stopped (SIGINT, so its traceback shows where it was, then
  SIGKILL and a restart if it is stuck inside a C++ call); the stop button stops every rank.
- Workers watch their parent and exit with it.
"""
from __future__ import annotations

import atexit
import collections
import linecache
import os
import pickle
import queue
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener

from ._shipping import dumps
from .timeline import Timeline

BACKENDS = ("auto", "gloo", "nccl")
START_TIMEOUT = 120.0  # seconds for a new worker to import torch and say hello
_STOP_GRACE = 0.2      # after a rank fails, how long the others get to fail on their own (lost peer)
_KILL_GRACE = 0.6      # after SIGINT, how long a rank gets to stop before SIGKILL
_LATE_GRACE = 0.75     # past the collective timeout, so a blocked collective reports its own timeout first
_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


class RankError(RuntimeError):
    """One or more ranks failed or did not finish.

    ``failures`` maps rank -> dict(type, message, traceback, exception); ``unfinished`` lists the ranks
    that were stopped; ``results`` holds the values of the ranks that finished (None elsewhere).
    """

    def __init__(self, message, failures=None, unfinished=(), results=None):
        super().__init__(message)
        self.failures = failures or {}
        self.unfinished = list(unfinished)
        self.results = results

    @property
    def ranks(self):
        return sorted(set(self.failures) | set(self.unfinished))

    def exception(self, rank):
        """The exception object raised on ``rank`` (None when it could not be sent back)."""
        blob = self.failures.get(rank, {}).get("exception")
        try:
            return pickle.loads(blob) if blob else None
        except Exception:
            return None


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> 'nccl' when there is one GPU per rank, else 'gloo'. Raises ValueError on bad input."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use 'auto' (NCCL with one GPU per rank, else Gloo), "
                         f"'gloo' (CPU) or 'nccl' (GPUs)")
    gpus = _gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine has "
                         f"{gpus} GPU(s). Use backend='gloo' (CPU) or at most {gpus} ranks.")
    return backend


def _describe_backend(backend, world_size, threads):
    if backend == "nccl":
        return f"NCCL on {world_size} GPU(s), one per rank"
    gpus = _gpu_count()
    why = "no GPU found" if gpus == 0 else f"{gpus} GPU(s) for {world_size} ranks: NCCL needs one per rank"
    return f"Gloo on CPU ({why}), {threads} torch thread(s) per rank"


def _signal_name(returncode):
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            pass
    return f"exit code {returncode}"


def _clean(message: str) -> str:
    """Gloo/c10d messages without their C++ source paths and option dumps."""
    message = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", message)
    message = re.sub(r"TensorOptions\(dtype=.*?device=([\w:]+).*?memory_format=\([^)]*\)\)", r"\1", message)
    return message.strip()


def _category(f) -> str:
    text = f["message"]
    if f["type"] in ("Stuck", "WorkerDied"):
        return f["type"]
    if f["interrupted"]:
        return "stopped"
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return "lost peer"
    if "Timed out" in text or "timed out" in text:
        return "timeout"
    return "error"


class _Worker:
    def __init__(self, rank, proc):
        self.rank, self.proc = rank, proc
        self.conn = None
        self.killed = False     # by us: restarted by the job that killed it
        self.last_words = collections.deque(maxlen=4)  # its latest stderr lines, quoted if it dies
        self.readers = []       # the threads reading its stdout and stderr
        self.offset_ns = 0      # worker clock - parent clock
        self.clock_error_ns = 0


class Cluster:
    """``world_size`` persistent ranks running ``torch.distributed`` code.

    backend: "auto" (NCCL with one GPU per rank, else Gloo on CPU), "gloo" or "nccl".
    timeout: seconds a collective may wait for its peers (the process group timeout), and how long
             the other ranks get to finish once one rank has finished.
    threads: torch threads per rank (default: CPU cores // world_size, at least 1).
    debug:   TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is checked across ranks first, so a
             mismatch (another op, shape or dtype on one rank) fails at once, naming both. Without it,
             Gloo may hang until the timeout, or even return a silently wrong sum when ranks pass
             tensors of different sizes to all_reduce. About 10x slower small collectives.
    """

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 10.0, *,
                 threads: int | None = None, debug: bool = False, quiet: bool = False):
        self.backend = resolve_backend(backend, world_size)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.world_size, self.timeout = world_size, float(timeout)
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._debug = bool(debug)
        self._gen = 0                 # process-group generation; bumped after any failure
        self._job_id = 0
        self._events: queue.Queue = queue.Queue()
        self._workers: dict[int, _Worker] = {}
        self._timeline: Timeline | None = None
        self._closed = False
        self._authkey = secrets.token_bytes(16)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="lablib-")
        self._listener = Listener(address=None if sys.platform == "win32" else
                                  os.path.join(self._tmpdir.name, "sock"), authkey=self._authkey)
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, wait_for_workers=False)
        threading.Thread(target=self._accept_loop, daemon=True, name="lablib-accept").start()
        _LIVE.add(self)
        t0 = time.perf_counter()
        try:
            for rank in range(world_size):
                self._spawn(rank)
            self.run(_noop)  # creates the process group now, so the first real job is fast
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - t0
        if not quiet:
            print(f"lablib: {world_size} rank(s), {_describe_backend(self.backend, world_size, self.threads)}; "
                  f"ready in {self.start_seconds:.1f} s")

    # -- public API ------------------------------------------------------------------------------
    @property
    def debug(self) -> bool:
        return self._debug

    @debug.setter
    def debug(self, value: bool):
        if bool(value) != self._debug:
            self._debug = bool(value)
            self._gen += 1  # the debug wrapper is chosen when the group is created

    def run(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises RankError when a rank raises or does not finish, KeyboardInterrupt when interrupted.
        """
        if self._closed:
            raise RuntimeError("this Cluster is closed; create a new one (or use lablib.cluster(n))")
        if not callable(fn):
            raise TypeError(f"run() needs a function to run on every rank, got {type(fn).__name__}")
        try:
            payload = dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"could not send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: {exc}. "
                            "Everything a rank needs must be picklable (tensors, numbers, functions; "
                            "not open files, locks or generators).") from exc
        self._wait_ready()
        self._job_id += 1
        msg = pickle.dumps(("job", self._job_id, self._gen, self._debug, payload, _cell_sources()))
        origin = time.perf_counter_ns()
        for w in self._workers.values():
            try:
                w.conn.send_bytes(msg)
            except OSError:
                pass  # its death is reported by the reader thread
        return self._collect(self._job_id, origin, getattr(fn, "__name__", "job"))

    def timeline(self) -> Timeline:
        """The merged per-rank timeline of the last job."""
        if self._timeline is None:
            raise RuntimeError("no job has run yet: call cluster.run(fn) first")
        return self._timeline

    def pids(self) -> list[int]:
        return [self._workers[r].proc.pid for r in range(self.world_size)]

    def close(self):
        """Stop every rank (within about a second) and free the socket and store."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers.values():
            try:
                w.conn.send_bytes(pickle.dumps(("exit",)))
            except (OSError, AttributeError):
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers.values():
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        try:
            self._listener.close()
        except OSError:
            pass
        self._tmpdir.cleanup()
        self._store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else "running"
        return f"<Cluster world_size={self.world_size} backend={self.backend} timeout={self.timeout}s {state}>"

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, rank):
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [here, os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
        env = dict(os.environ,
                   LABLIB_PARENT_PID=str(os.getpid()), LABLIB_RANK=str(rank), LABLIB_WORLD_SIZE=str(self.world_size),
                   LABLIB_THREADS=str(self.threads), LABLIB_BACKEND=self.backend, LABLIB_TIMEOUT=str(self.timeout),
                   LABLIB_ADDRESS=self._listener.address, LABLIB_AUTHKEY=self._authkey.hex(),
                   LABLIB_STORE_HOST="127.0.0.1", LABLIB_STORE_PORT=str(self._store.port),
                   PYTHONPATH=os.pathsep.join(dict.fromkeys(path)), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-c", "from lablib._worker import main; main()"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            # Own session: the terminal's Ctrl-C or Jupyter's interrupt reach the parent only, which
            # then stops the ranks in order.
            start_new_session=True)
        w = self._workers[rank] = _Worker(rank, proc)
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            reader = threading.Thread(target=self._pipe_loop, args=(w, stream, pipe), daemon=True,
                                      name=f"lablib-rank{rank}-{stream}")
            reader.start()
            w.readers.append(reader)

    def _accept_loop(self):
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if self._closed:
                    return
                continue
            # A rank connects first and says hello once torch is imported: greet each one in its own
            # thread, so the ranks import torch side by side.
            threading.Thread(target=self._greet, args=(conn,), daemon=True, name="lablib-greet").start()

    def _greet(self, conn):
        try:
            kind, rank, pid = pickle.loads(conn.recv_bytes())
        except (OSError, EOFError, pickle.UnpicklingError, ValueError):
            conn.close()
            return
        w = self._workers.get(rank)
        if w is None or w.proc.pid != pid:
            conn.close()
            return
        try:
            # Align clocks: several ping-pongs, keep the one with the smallest round trip. Ranks on
            # one machine share a monotonic clock, so an offset within the round-trip error is zero.
            best = None
            for _ in range(5):
                t0 = time.perf_counter_ns()
                conn.send_bytes(pickle.dumps(("ping",)))
                _, tw = pickle.loads(conn.recv_bytes())
                t1 = time.perf_counter_ns()
                if best is None or t1 - t0 < best[0]:
                    best = (t1 - t0, tw - (t0 + t1) // 2)
        except (OSError, EOFError):
            conn.close()
            return
        rtt, offset = best
        w.offset_ns = 0 if abs(offset) <= rtt else offset
        w.clock_error_ns = rtt // 2
        w.conn = conn
        self._conn_loop(w, conn)

    def _conn_loop(self, w, conn):
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._events.put(("lost", w.rank, w))
                return
            self._events.put((msg[0], w.rank, w) + tuple(msg[1:]))

    def _pipe_loop(self, w, stream, pipe):
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace")
            if stream == "stderr" and text.strip() and not text.startswith("[W"):  # c10d warnings are noise here
                w.last_words.append(text.strip())
            self._events.put(("out", w.rank, None, stream, text))
        pipe.close()

    def _wait_ready(self):
        """Block until every worker has connected (workers restarted after a kill take a few s)."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            missing = [w for w in self._workers.values() if w.conn is None]
            if not missing:
                return
            for w in missing:
                if w.proc.poll() is not None:
                    self._drain_output(0.2)
                    self.close()
                    raise RuntimeError(f"rank {w.rank} exited while starting ({_signal_name(w.proc.returncode)}); "
                                       "its output is above. Run `lablib doctor` to check the installation.")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"ranks {[w.rank for w in missing]} did not start within {START_TIMEOUT:.0f} s")
            try:
                self._handle_idle(self._events.get(timeout=0.05))
            except queue.Empty:
                pass

    def _handle_idle(self, ev):
        if ev[0] == "out":
            self._print(ev[1], ev[3], ev[4])
        elif ev[0] == "lost" and ev[2] is self._workers.get(ev[1]) and not ev[2].killed and not self._closed:
            w = ev[2]
            w.proc.wait()
            print(f"lablib: rank {w.rank} exited between jobs ({_signal_name(w.proc.returncode)}); restarting it",
                  file=sys.stderr)
            self._gen += 1
            self._spawn(w.rank)

    def _drain_output(self, seconds):
        """Print what the ranks wrote, for ``seconds`` (0: just what has arrived)."""
        end = time.monotonic() + seconds
        while True:
            try:
                self._handle_idle(self._events.get(timeout=max(0.0, min(0.02, end - time.monotonic()))))
            except queue.Empty:
                if time.monotonic() >= end:
                    return

    @staticmethod
    def _print(rank, stream, text):
        out = sys.stderr if stream == "stderr" else sys.stdout
        lines = text.splitlines(keepends=True)
        out.write("".join(f"[rank {rank}] {line}" for line in lines))
        out.flush()

    # -- one job ---------------------------------------------------------------------------------
    def _collect(self, job_id, origin, title):
        pending = set(range(self.world_size))
        results, failures, raw_spans, killed = {}, {}, {}, set()
        first_ok = first_error = stop_sent = None
        interrupted = False
        stop_reason = ""
        while pending:
            try:
                try:
                    ev = self._events.get(timeout=0.02)
                except queue.Empty:
                    ev = None
                if ev is not None:
                    kind, rank, w = ev[0], ev[1], ev[2]
                    if kind == "out":
                        self._print(rank, ev[3], ev[4])
                    elif kind == "done" and ev[3] == job_id and rank in pending:
                        _, _, _, _, outcome, spans, t_start, t_end, pg_alive = ev
                        pending.discard(rank)
                        raw_spans[rank] = spans
                        if outcome[0] == "ok":
                            results[rank] = outcome[1]
                            first_ok = first_ok or time.monotonic()
                            if not pg_alive:
                                self._gen += 1
                        else:
                            failures[rank] = outcome[1]
                            first_error = first_error or time.monotonic()
                    elif kind == "lost" and rank in pending and w is self._workers.get(rank):
                        w.proc.wait()
                        for reader in w.readers:  # its pipes end with it: read to the end, for its last words
                            reader.join(1.0)
                        pending.discard(rank)
                        killed.add(rank)
                        said = "; its last output:\n    " + "\n    ".join(w.last_words) if w.last_words else ""
                        failures[rank] = {"type": "WorkerDied", "time": time.perf_counter_ns(), "exception": None,
                                          "message": f"rank {rank} died ({_signal_name(w.proc.returncode)}){said}",
                                          "traceback": "", "interrupted": False}
                        first_error = first_error or time.monotonic()
                now = time.monotonic()
                if pending and stop_sent is None:
                    if first_error is not None and now - first_error > _STOP_GRACE:
                        stop_reason = "another rank failed"
                    elif first_ok is not None and now - first_ok > self.timeout + _LATE_GRACE:
                        stop_reason = f"still running {self.timeout:g} s after rank {min(results)} finished"
                    if stop_reason:
                        self._interrupt(pending)
                        stop_sent = now
                if pending and stop_sent is not None and now - stop_sent > _KILL_GRACE:
                    for rank in pending:
                        self._kill(rank)
                        killed.add(rank)
                        failures.setdefault(rank, {
                            "type": "Stuck", "time": time.perf_counter_ns(), "exception": None, "interrupted": True,
                            "traceback": "",
                            "message": "did not respond to SIGINT (stuck inside a C++ call, usually a collective "
                                       "waiting for a peer); the process was killed and restarted"})
                    pending.clear()
            except KeyboardInterrupt:
                if interrupted:  # pressed twice: no more waiting
                    for rank in pending:
                        self._kill(rank)
                        killed.add(rank)
                    pending.clear()
                    break
                interrupted = True
                stop_reason = "interrupted"
                self._interrupt(pending)
                stop_sent = time.monotonic()
        self._drain_output(0.0)
        for rank in killed:
            self._spawn(rank)  # restarted in the background; the next run waits for it
        if failures or killed or interrupted:
            self._gen += 1
        self._timeline = Timeline.from_raw(
            raw_spans, {r: w.offset_ns for r, w in self._workers.items()}, origin, self.world_size,
            clock_error=max((w.clock_error_ns for w in self._workers.values()), default=0) / 1e9, title=title)
        if interrupted:
            print(f"lablib: interrupted; stopped ranks {sorted(set(failures) | killed)}. The cluster is ready "
                  "for the next run.", file=sys.stderr)
            raise KeyboardInterrupt
        values = {}
        for rank, blob in results.items():
            try:
                values[rank] = pickle.loads(blob)
            except Exception as exc:
                failures[rank] = {"type": type(exc).__name__, "message": f"its result could not be unpickled here: {exc}",
                                  "traceback": "", "exception": None, "interrupted": False, "time": 0}
        if failures:
            ordered = [values.get(r) for r in range(self.world_size)]
            raise RankError(_failure_message(failures, set(values) - set(failures), stop_reason, self.world_size,
                                             self.timeout),
                            failures, [r for r in failures if _category(failures[r]) in ("stopped", "Stuck")], ordered)
        return [values[r] for r in range(self.world_size)]

    def _interrupt(self, ranks):
        for rank in ranks:
            try:
                self._workers[rank].proc.send_signal(signal.SIGINT)
            except (ProcessLookupError, OSError):
                pass

    def _kill(self, rank):
        w = self._workers[rank]
        w.conn, w.killed = None, True
        try:
            w.proc.kill()
            w.proc.wait(5)
        except (ProcessLookupError, OSError, subprocess.TimeoutExpired):
            pass


def _noop():
    return None


def _cell_sources():
    """Source lines of notebook cells (not files on disk), so remote tracebacks can quote them."""
    return {f: e[2] for f, e in list(linecache.cache.items())
            if len(e) == 4 and e[2] and ("ipykernel" in f or f.startswith("<")) and not os.path.exists(f)}


def _failure_message(failures, finished, stop_reason, world_size, timeout):
    """Root cause first (the earliest real error), then one line per other rank, then tracebacks."""
    cats = {r: _category(f) for r, f in failures.items()}
    rank_order = ["error", "WorkerDied", "timeout", "stopped", "Stuck", "lost peer"]
    ranks = sorted(failures, key=lambda r: (rank_order.index(cats[r]), failures[r].get("time", 0)))
    root = ranks[0]
    f = failures[root]

    def op(r):
        return failures[r].get("op") or "a collective"

    if cats[root] in ("error", "WorkerDied"):
        head = f"rank {root} of {world_size} failed: " + (
            _clean(f["message"]) if cats[root] == "WorkerDied" else f"{f['type']}: {_clean(f['message'])}")
        others = ranks[1:]
    elif cats[root] == "timeout":
        timed = sorted(r for r in ranks if cats[r] == "timeout")
        head = (f"rank(s) {_join(timed)} of {world_size} timed out after {timeout:g} s waiting for a peer: "
                + ", ".join(f"rank {r} in {op(r)}" for r in timed))
        others = [r for r in ranks if cats[r] != "timeout"]
    else:
        head = f"rank(s) {_join(sorted(ranks))} of {world_size} did not finish ({stop_reason})"
        others = ranks
    lines = [head]
    for r in sorted(others, key=lambda r: (rank_order.index(cats[r]), r)):
        c, msg = cats[r], failures[r]["message"]
        lines.append(f"  rank {r}: " + {
            "lost peer": f"left {op(r)} because a peer had failed (Connection closed by peer)",
            "timeout": f"{op(r)} timed out after {timeout:g} s waiting for a peer",
            "stopped": "did not finish; stopped by lablib (where it was: below)",
            "Stuck": "stuck inside a C++ call (usually a collective waiting for a peer) and did not respond to "
                     "SIGINT; killed and restarted",
            "WorkerDied": msg,
            "error": f"{failures[r]['type']}: {_clean(msg)[:200]}",
        }[c])
    if finished:
        lines.append(f"  finished: rank(s) {_join(sorted(finished))}")
    if "timeout" in cats.values() and any(op(r) in ("send", "recv") for r in ranks):
        lines.append("Hint: a blocking send waits until its peer receives (and a recv until its peer sends). If "
                     "both sides of a pair send first, both wait forever: alternate the order (even ranks send "
                     "first, odd ranks receive first), or post isend/irecv and then wait on both.")
    elif "timeout" in cats.values():
        lines.append(f"Hint: a collective waited {timeout:g} s for a peer that never joined it. Every rank must call "
                     "the same collectives in the same order, with matching shapes; Cluster(debug=True) names the "
                     "first mismatch at once.")
    # Two tracebacks at most: the root cause, and where a stopped rank was (else a second view of it).
    with_tb = [r for r in ranks if failures[r]["traceback"] and cats[r] in ("error", "timeout", "stopped")]
    stopped = [r for r in with_tb[1:] if cats[r] == "stopped"]
    second = [r for r in with_tb[1:] if op(r) != op(with_tb[0]) or cats[r] != cats[with_tb[0]]]
    for r in with_tb[:1] + (stopped or second)[:1]:
        title = "where it was stopped" if cats[r] == "stopped" else "traceback"
        lines.append(f"\n--- rank {r} {title} ---\n{_clean(failures[r]['traceback'].rstrip())}")
    return "\n".join(lines)


def _join(ranks):
    return ", ".join(map(str, ranks))


# -- the notebook-wide pool ------------------------------------------------------------------------
_shared: Cluster | None = None


def cluster(world_size: int | None = None, **kwargs) -> Cluster:
    """The notebook's shared pool: reused by every cell, restarted when asked for another size/options.

    ``lablib.cluster(4)`` gives 4 ranks; ``lablib.cluster()`` gives the current pool (2 ranks if none).
    """
    global _shared
    c = _shared
    want = world_size if world_size is not None else (c.world_size if c and not c._closed else 2)
    if c is not None and not c._closed and c.world_size == want and _matches(c, kwargs):
        return c
    if c is not None:
        c.close()
    _shared = None
    _shared = Cluster(want, **kwargs)
    return _shared


def _matches(c, kwargs):
    for key, value in kwargs.items():
        if key == "quiet":
            continue
        if key == "backend":
            if value != "auto" and value != c.backend:
                return False
        elif key == "debug":
            c.debug = value
        elif getattr(c, key, None) != value:
            return False
    return True


@atexit.register
def _close_all():
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:
            pass
