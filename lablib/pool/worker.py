"""One rank of a ``Cluster``: started once by the parent, it runs the jobs the parent ships, in a loop.

Started as ``python -c "from lablib.pool.worker import main; main()"`` with its identity in LABLIB_*
environment variables; it imports torch, greets the parent (``Hello``) and then answers each ``Job``
with a ``Done``. It imports nothing from the notebook side of lablib (plotly, ipywidgets).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from . import groups
from . import protocol as P



def _die_with_parent(parent_pid: int) -> None:
    """Exit when the parent does (a kernel crash or restart must not leave ranks behind)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # PR_SET_PDEATHSIG: the kernel sends SIGKILL the moment the parent dies
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass

    def watch():  # portable fallback: being re-parented means the parent is gone
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(0.25)

    if os.getppid() != parent_pid:
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="lablib-parent-watch").start()


class _RankStream:
    """sys.stdout/sys.stderr of a rank: whole lines are sent to the parent as they are written."""

    def __init__(self, send, name):
        self._send, self.name, self._buf = send, name, ""
        self._lock = threading.Lock()

    def write(self, text):
        with self._lock:
            self._buf += text
            if "\n" in self._buf:
                head, self._buf = self._buf.rsplit("\n", 1)
                self._send(P.Out(self.name, head + "\n"))
        return len(text)

    def flush(self):
        with self._lock:
            if self._buf:
                self._send(P.Out(self.name, self._buf))
                self._buf = ""

    def isatty(self):
        return False

    @property
    def encoding(self):
        return "utf-8"

    def fileno(self):
        return 1 if self.name == "stdout" else 2


class _State:
    running = False  # a job's function is executing: only then does SIGINT interrupt it


def _on_sigint(signum, frame):
    # The parent sends SIGINT to stop a job; one that arrives after the job ended is ignored.
    if _State.running:
        _State.running = False
        raise KeyboardInterrupt("stopped by lablib")


class _Rank:
    """This process's connection, identity and process group."""

    def __init__(self):
        from multiprocessing.connection import Client

        env = os.environ
        self.rank, self.world_size = int(env["LABLIB_RANK"]), int(env["LABLIB_WORLD_SIZE"])
        self.backend, self.timeout_s = env["LABLIB_BACKEND"], float(env["LABLIB_TIMEOUT"])
        self.conn = Client(env["LABLIB_ADDRESS"], authkey=bytes.fromhex(env.pop("LABLIB_AUTHKEY")))
        self._send_lock = threading.Lock()
        self.gen = None  # generation of the live process group
        self.group = None  # id() of the default group lablib made: a reference would keep its sockets open

    def send(self, msg):
        data = P.encode(msg)
        with self._send_lock:
            self.conn.send_bytes(data)

    def connect_store(self):
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["LABLIB_THREADS"]))
        self.timeout = datetime.timedelta(seconds=self.timeout_s)
        groups.install(self.timeout_s)  # a job's own groups: the pool's timeout, and alike on every rank
        if os.environ.get("LABLIB_DEVICE") == "cuda":  # its own GPU under NCCL; else shared round-robin
            from .backend import gpu_of

            torch.cuda.set_device(gpu_of(self.rank))
        self.store = dist.TCPStore(os.environ["LABLIB_STORE_HOST"], int(os.environ["LABLIB_STORE_PORT"]),
                                   self.world_size, False, timeout=self.timeout)

    def ensure_process_group(self, gen: int, debug: bool):
        import torch.distributed as dist

        if gen == self.gen and dist.is_initialized():
            return
        self.destroy_process_group()
        dist.set_debug_level(dist.DebugLevel.DETAIL if debug else dist.DebugLevel.OFF)
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if debug else "OFF"
        # A fresh key prefix per generation: a group re-created after a failure never sees the
        # keys of the one it replaces.
        pg_backend = "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo"
        dist.init_process_group(pg_backend, store=dist.PrefixStore(f"pg{gen}", self.store), rank=self.rank,
                                world_size=self.world_size, timeout=self.timeout)
        # Nobody starts the job until everyone is connected: a rank that failed at once would
        # otherwise close its sockets while a slower peer is still connecting to them, and that
        # peer would wait for the full timeout.
        dist.barrier()
        self.gen, self.group = gen, id(_default_group())

    def check_process_group(self):
        """After a job: if it replaced the default process group (another size, or another group),
        drop that group with a warning, so the next job gets lablib's own again."""
        import torch.distributed as dist

        if not dist.is_initialized() or (id(_default_group()) == self.group
                                         and dist.get_world_size() == self.world_size):
            return
        size = dist.get_world_size()
        print(f"lablib: rank {self.rank}: this job replaced the default process group (now {size} rank(s), not "
              f"{self.world_size}); lablib restores its own {self.world_size}-rank group for the next job. Use "
              "dist.new_group(...) for a group of some ranks, and pass it as group=.", file=sys.stderr)
        self.destroy_process_group()

    @staticmethod
    def destroy_process_group():
        # Closing our connections makes peers blocked on us fail at once ("Connection closed by
        # peer") instead of waiting for the timeout.
        import torch.distributed as dist

        from .. import p2p

        p2p.forget()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _default_group():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def describe(exc: BaseException) -> P.Failure:
    """The exception as the parent reports it: the learner's frames, and the collective it failed in."""
    import traceback

    import cloudpickle

    from .. import device_audit, gputime

    tb = exc.__traceback__
    wrappers = (__file__, device_audit.__file__, gputime.__file__)
    while tb is not None and tb.tb_frame.f_code.co_filename in wrappers:
        tb = tb.tb_next  # drop the frames that call the job: the learner's code starts below them
    te = traceback.TracebackException(type(exc), exc, tb)
    # The collective that failed, e.g. "all_reduce", names the problem better than Gloo's text.
    op = next((f.name for f in reversed(te.stack) if f.filename.endswith("distributed_c10d.py")), None)
    op = op or getattr(exc, "lablib_op", None)  # else the one whose handle it waited on (work.py names it)
    # c10d_logger.py only wraps every collective: its frames are noise to a learner.
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if not f.filename.endswith("c10d_logger.py")])
    try:
        blob = cloudpickle.dumps(exc)
    except Exception:
        blob = None
    try:
        message = str(exc)
    except Exception as inner:  # an exception whose __str__ itself fails must still be reported
        message = f"<str() of the {type(exc).__name__} failed: {type(inner).__name__}: {inner}>"
    return P.Failure(type(exc).__name__, message, "".join(te.format()), blob, op,
                     isinstance(exc, KeyboardInterrupt), time.perf_counter_ns())


def gpu_broken(failure: P.Failure) -> bool:
    """Whether this rank's GPU can no longer be used: a CUDA error such as a device-side assert (an index out of
    range in a kernel) or an illegal memory access stays with the process, and every later call fails with it.
    A failure that says so, or a stream that reports one when asked (without waiting), means the rank must be
    restarted."""
    if "CUDA error" in failure.message or "device-side assert" in failure.message or failure.type == "AcceleratorError":
        return True
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.current_stream().query()
    except Exception:  # noqa: BLE001 - any error here is the sticky one
        return True
    return False


def run_job(me: _Rank, job: P.Job) -> P.Done:
    import linecache

    import torch.distributed as dist

    from .. import flight, p2p
    from ..device_audit import audited
    from ..gputime import timed_on_device
    from ..timeline import RECORDER

    for filename, lines in job.sources.items():  # so tracebacks show notebook cell source
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    RECORDER.start()
    value = failure = None
    try:
        me.ensure_process_group(job.gen, job.debug)
        groups.job_started()
        p2p.job_started(job.job_id)
        flight.started()
        fn, args, kwargs = P.unship(job.payload)
        if os.environ.get("LABLIB_DEVICE") == "cuda":  # the tensors a job is given arrive on its device
            import torch
            from torch.utils._pytree import tree_map

            from ..comm import to_device

            args, kwargs = tree_map(lambda v: to_device(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        _State.running = True
        try:
            result = timed_on_device(fn, args, kwargs, audited)
        finally:
            _State.running = False
        value = P.ship(result, to_cpu=True)
        me.check_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the cell
        _State.running = False
        failure = describe(exc)
        failure.restart = gpu_broken(failure)
        me.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    return P.Done(job.job_id, value, failure, RECORDER.stop(), dist.is_initialized())


def main() -> None:
    # the process that started this rank: the notebook's, or the fork server's (zygote.py), which dies with it
    _die_with_parent(int(os.environ.get("LABLIB_SERVER_PID") or os.environ["LABLIB_PARENT_PID"]))
    threads = os.environ["LABLIB_THREADS"]
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = threads
    signal.signal(signal.SIGINT, _on_sigint)
    if os.environ.get("LABLIB_GRADING") == "1":  # exercise code run here starts no process, and keeps the
        from ..rules.namespace import guard_processes, rebuild_with_exercise_builtins  # builtins it had in the box

        guard_processes()
        rebuild_with_exercise_builtins()
    me = _Rank()
    me.connect_store()
    sys.stdout, sys.stderr = _RankStream(me.send, "stdout"), _RankStream(me.send, "stderr")
    me.send(P.Hello(me.rank, os.getpid()))
    while True:
        try:
            msg = P.decode(me.conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        except KeyboardInterrupt:
            continue
        if isinstance(msg, P.Ping):
            me.send(P.Pong(time.perf_counter_ns()))
        elif isinstance(msg, P.Job):
            me.send(run_job(me, msg))
        else:  # Exit
            break
    me.destroy_process_group()
    # Nothing is left to save: skip the interpreter's teardown, which takes torch about a second and
    # would have the pool's close() wait for it (or kill the rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
