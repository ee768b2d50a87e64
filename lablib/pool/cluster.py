"""A persistent pool of ranks: real processes running real ``torch.distributed`` code for a notebook.

    with Cluster(4) as cluster:
        cluster.run(fn, x)          # fn(x) on every rank, results in rank order
        cluster.timeline()          # what every rank did when, on one clock

Why a pool and not ``mp.spawn`` per cell: each new process pays ``import torch`` (1-3 s here, more
when 4 start at once on 2 cores); a pool pays it once and then runs a job in a few milliseconds.

How it stays out of the way of the learner:
- Workers are forked from a server that has imported torch and done nothing else (zygote.py), never
  from the kernel (a process that has run a torch op hangs a forked child), and are reused; the
  process group is created once, and again only after a failure.
- Functions are shipped by value with cloudpickle (``protocol.ship``), so ``fn`` may be defined in the
  notebook and use its globals.
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
import contextlib
import glob
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener

from .. import flight
from ..paths import ROOT
from ..timeline import Timeline
from . import protocol as P
from . import zygote
from .backend import describe_backend, resolve_backend, resolve_device
from .failures import signal_name
from .job import LOST, Job, StopButton, cell_sources, heard, print_output

START_TIMEOUT = 120.0  # seconds for a new worker to import torch and say hello
_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


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

    backend: "auto" (NCCL with one GPU per rank, else Gloo), "gloo" or "nccl".
    device:  where each rank computes: "auto" (the GPUs where there are any: one per rank, or shared
             round-robin when there are fewer GPUs than ranks; else the CPU), "cpu" or "cuda".
    timeout: seconds a collective may wait for its peers (the process group timeout), and how long
             the other ranks get to finish once one rank has finished.
    threads: torch threads per rank (default: CPU cores // world_size, at least 1).
    debug:   TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is checked across ranks first, so a
             mismatch (another op, shape or dtype on one rank) fails at once, naming both. Without it,
             Gloo may hang until the timeout, or even return a silently wrong sum when ranks pass
             tensors of different sizes to all_reduce. About 10x slower small collectives.
    job_limit: seconds a job may run in all (None: no limit). ``timeout`` stops ranks that wait for a
             peer; a job whose ranks all keep computing is stopped only by this limit (or the stop
             button). Can be changed at any time: ``cluster.job_limit = 60``.
    """

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 10.0, *,
                 threads: int | None = None, debug: bool = False, job_limit: float | None = None,
                 quiet: bool = False, device: str = "auto"):
        from ..rules.namespace import refuse_from_exercise

        refuse_from_exercise(f"lablib.cluster({world_size})")
        self.backend = resolve_backend(backend, world_size, device)
        self.device = resolve_device(device, self.backend)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if job_limit is not None and (not isinstance(job_limit, (int, float)) or job_limit <= 0):
            raise ValueError(f"job_limit must be a positive number of seconds or None, got {job_limit!r}")
        self.world_size, self.timeout, self.job_limit = world_size, float(timeout), job_limit
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._debug = bool(debug)
        self._gen = 0                 # process-group generation; bumped after any failure
        self._job_id = 0
        self._events: queue.Queue = queue.Queue()  # (worker, message) from every rank
        self._workers: dict[int, _Worker] = {}
        self._timeline: Timeline | None = None
        self._closed = False
        self._authkey = secrets.token_bytes(16)
        self._spawning = threading.Lock()  # from a rank's start until it is recorded: _greet waits for it
        _remove_stale_folders()
        self._tmpdir = tempfile.TemporaryDirectory(prefix=f"lablib-{os.getpid()}-")
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
            print(f"lablib: {world_size} rank(s), {describe_backend(self.backend, world_size, self.threads, self.device)}; "
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
        with StopButton() as stop:
            try:
                payloads = P.payloads(fn, args, kwargs, self.world_size)
            except Exception as exc:
                raise TypeError(f"could not send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
                                f"{exc}. Everything a rank needs must be picklable (tensors, numbers, functions; "
                                "not open files, locks or generators).") from exc
            self._wait_ready()
            if stop.presses:  # pressed before the job was sent: nothing to stop on the ranks
                raise KeyboardInterrupt
            self._job_id += 1
            messages = P.messages(self._job_id, self._gen, self._debug, payloads, cell_sources())
            origin = time.perf_counter_ns()
            for r, w in self._workers.items():
                try:
                    w.conn.send_bytes(messages[r])
                except OSError:
                    pass  # its death is reported by the reader thread
            return self._collect(Job(self, self._job_id), stop, origin, getattr(fn, "__name__", "job"))

    @property
    def closed(self) -> bool:
        return self._closed

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
                w.conn.send_bytes(P.encode(P.Exit()))
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
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self):
        state = "closed" if self._closed else "running"
        return f"<Cluster world_size={self.world_size} backend={self.backend} device={self.device} timeout={self.timeout}s {state}>"

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, rank):
        path = [str(ROOT), os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
        env = dict(os.environ,
                   LABLIB_PARENT_PID=str(os.getpid()), LABLIB_RANK=str(rank), LABLIB_WORLD_SIZE=str(self.world_size),
                   LABLIB_THREADS=str(self.threads), LABLIB_BACKEND=self.backend, LABLIB_DEVICE=self.device, LABLIB_TIMEOUT=str(self.timeout),
                   LABLIB_ADDRESS=self._listener.address, LABLIB_AUTHKEY=self._authkey.hex(),
                   LABLIB_FLIGHT=flight.file(self._tmpdir.name, rank),
                   LABLIB_STORE_HOST="127.0.0.1", LABLIB_STORE_PORT=str(self._store.port),
                   PYTHONPATH=os.pathsep.join(dict.fromkeys(path)), PYTHONUNBUFFERED="1")
        with self._spawning:
            proc = zygote.start(env, os.getcwd(), list(dict.fromkeys(path)))
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
            hello = P.decode(conn.recv_bytes())
            with self._spawning:
                w = self._workers.get(hello.rank) if isinstance(hello, P.Hello) else None
            if w is None or w.proc.pid != hello.pid:
                conn.close()
                return
            rtt, offset = P.clock_offset(conn)
        except (OSError, EOFError, ValueError, AttributeError):
            conn.close()
            return
        w.offset_ns = 0 if abs(offset) <= rtt else offset
        w.clock_error_ns = rtt // 2
        w.conn = conn
        self._conn_loop(w, conn)

    def _conn_loop(self, w, conn):
        while True:
            try:
                msg = P.decode(conn.recv_bytes())
            except (EOFError, OSError):
                self._events.put((w, LOST))
                return
            self._events.put((w, msg))

    def _pipe_loop(self, w, stream, pipe):
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace")
            if heard(w, stream, text):
                self._events.put((w, P.Out(stream, text)))
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
                    raise RuntimeError(f"rank {w.rank} exited while starting ({signal_name(w.proc.returncode)}); "
                                       "its output is above. Run `lablib doctor` to check the installation.")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"ranks {[w.rank for w in missing]} did not start within {START_TIMEOUT:.0f} s")
            try:
                self._handle_idle(*self._events.get(timeout=0.05))
            except queue.Empty:
                pass

    def _handle_idle(self, w, msg):
        """An event between jobs: print output; restart a rank that exited."""
        if isinstance(msg, P.Out):
            print_output(w.rank, msg)
        elif msg is LOST and w is self._workers.get(w.rank) and not w.killed and not self._closed:
            w.proc.wait()
            print(f"lablib: rank {w.rank} exited between jobs ({signal_name(w.proc.returncode)}); restarting it",
                  file=sys.stderr)
            self._gen += 1
            self._spawn(w.rank)

    def _drain_output(self, seconds):
        """Print what the ranks wrote, for ``seconds`` (0: just what has arrived)."""
        end = time.monotonic() + seconds
        while True:
            try:
                self._handle_idle(*self._events.get(timeout=max(0.0, min(0.02, end - time.monotonic()))))
            except queue.Empty:
                if time.monotonic() >= end:
                    return

    # -- one job ---------------------------------------------------------------------------------
    def _collect(self, job: Job, stop: StopButton, origin, title):
        """Wait for every rank's ``Done`` (or stop the ranks that do not finish); return the results."""
        pressed = 0
        while job.pending:
            try:
                try:
                    w, msg = self._events.get(timeout=0.02)
                    job.on_event(w, msg)
                except queue.Empty:
                    pass
                job.enforce_deadlines(time.monotonic())
            except KeyboardInterrupt:  # where the stop button could not be caught (run from another thread)
                stop.presses += 1
            if stop.presses > pressed:
                pressed = stop.presses
                if not job.stop_pressed():
                    break
        self._drain_output(0.0)
        job.flights = flight.read_all(self._tmpdir.name, self.world_size) if job.failures else {}  # before restarts
        for rank in job.killed:
            self._spawn(rank)  # restarted in the background; the next run waits for it
        if job.failures or job.killed or job.interrupted:
            self._gen += 1
        self._timeline = Timeline.from_raw(
            job.raw_spans, {r: w.offset_ns for r, w in self._workers.items()}, origin, self.world_size,
            clock_error=max((w.clock_error_ns for w in self._workers.values()), default=0) / 1e9, title=title)
        if job.interrupted:
            print(f"lablib: interrupted; stopped ranks {sorted(set(job.failures) | job.killed)}. The cluster is ready "
                  "for the next run.", file=sys.stderr)
            raise KeyboardInterrupt
        return job.outcome()

    def _interrupt(self, ranks):
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, OSError):
                self._workers[rank].proc.send_signal(signal.SIGINT)

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


def _remove_stale_folders():
    """Remove the socket folders of pools whose notebook was killed (SIGKILL skips every cleanup): each
    folder is named after the process that made it."""
    import shutil

    for path in glob.glob(os.path.join(tempfile.gettempdir(), "lablib-*-*")):
        pid = os.path.basename(path).split("-")[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # someone else's live process
            pass


@atexit.register
def _close_all():
    for c in list(_LIVE):
        with contextlib.suppress(Exception):
            c.close()
