"""One rank of a ``Cluster``: started once by the parent, it runs the jobs the parent ships, in a loop.

Protocol (pickled tuples over a ``multiprocessing.connection`` socket, authenticated):
  parent -> rank: ("ping",) | ("job", job_id, gen, debug, payload, source_lines) | ("exit",)
  rank -> parent: ("hello", rank, pid) | ("pong", t_ns) | ("out", stream, text)
                | ("done", job_id, outcome, spans, t_start_ns, t_end_ns, pg_alive)

Python-level prints travel on the same socket as the result, so a rank's output always reaches the
cell before its result does. C-level output (Gloo, c10d) goes to this process's stdout/stderr pipes,
which the parent also reads.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time


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
                self._send(("out", self.name, head + "\n"))
        return len(text)

    def flush(self):
        with self._lock:
            if self._buf:
                self._send(("out", self.name, self._buf))
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


def main() -> None:
    parent_pid = int(os.environ["LABLIB_PARENT_PID"])
    _die_with_parent(parent_pid)
    rank, world_size = int(os.environ["LABLIB_RANK"]), int(os.environ["LABLIB_WORLD_SIZE"])
    threads = int(os.environ["LABLIB_THREADS"])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    signal.signal(signal.SIGINT, _on_sigint)

    from multiprocessing.connection import Client

    conn = Client(os.environ["LABLIB_ADDRESS"], authkey=bytes.fromhex(os.environ.pop("LABLIB_AUTHKEY")))
    send_lock = threading.Lock()

    def send(msg):
        import pickle

        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            conn.send_bytes(data)

    import datetime
    import linecache
    import pickle
    import traceback

    import cloudpickle
    import torch
    import torch.distributed as dist

    from ._shipping import dumps
    from .timeline import RECORDER

    torch.set_num_threads(threads)
    backend = os.environ["LABLIB_BACKEND"]
    timeout = datetime.timedelta(seconds=float(os.environ["LABLIB_TIMEOUT"]))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(os.environ["LABLIB_STORE_HOST"], int(os.environ["LABLIB_STORE_PORT"]),
                          world_size, False, timeout=timeout)
    sys.stdout, sys.stderr = _RankStream(send, "stdout"), _RankStream(send, "stderr")
    send(("hello", rank, os.getpid()))

    current_gen = None

    def ensure_process_group(gen, debug):
        nonlocal current_gen
        if gen == current_gen and dist.is_initialized():
            return
        destroy_process_group()
        dist.set_debug_level(dist.DebugLevel.DETAIL if debug else dist.DebugLevel.OFF)
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if debug else "OFF"
        # A fresh key prefix per generation: a group re-created after a failure never sees the
        # keys of the one it replaces.
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(pg_backend, store=dist.PrefixStore(f"pg{gen}", store), rank=rank,
                                world_size=world_size, timeout=timeout)
        # Nobody starts the job until everyone is connected: a rank that failed at once would
        # otherwise close its sockets while a slower peer is still connecting to them, and that
        # peer would wait for the full timeout.
        dist.barrier()
        current_gen = gen

    def destroy_process_group():
        # Closing our connections makes peers blocked on us fail at once ("Connection closed by
        # peer") instead of waiting for the timeout.
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def describe(exc):
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # drop this file's frames: the learner's code starts below them
        te = traceback.TracebackException(type(exc), exc, tb)
        # The collective that failed, e.g. "all_reduce", names the problem better than Gloo's text.
        op = next((f.name for f in reversed(te.stack) if f.filename.endswith("distributed_c10d.py")), None)
        # c10d_logger.py only wraps every collective: its frames are noise to a learner.
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if not f.filename.endswith("c10d_logger.py")])
        text = "".join(te.format())
        try:
            blob = cloudpickle.dumps(exc)
        except Exception:
            blob = None
        return {"type": type(exc).__name__, "message": str(exc), "traceback": text, "exception": blob, "op": op,
                "interrupted": isinstance(exc, KeyboardInterrupt), "time": time.perf_counter_ns()}

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        except KeyboardInterrupt:
            continue
        if msg[0] == "ping":
            send(("pong", time.perf_counter_ns()))
            continue
        if msg[0] == "exit":
            break
        _, job_id, gen, debug, payload, source_lines = msg
        for filename, lines in source_lines.items():  # so tracebacks show notebook cell source
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        t_start = time.perf_counter_ns()
        RECORDER.start()
        try:
            ensure_process_group(gen, debug)
            fn, args, kwargs = cloudpickle.loads(payload)
            _State.running = True
            try:
                value = fn(*args, **kwargs)
            finally:
                _State.running = False
            outcome = ("ok", dumps(value, to_cpu=True))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the cell
            _State.running = False
            outcome = ("error", describe(exc))
            destroy_process_group()
        t_end = time.perf_counter_ns()
        sys.stdout.flush()
        sys.stderr.flush()
        send(("done", job_id, outcome, RECORDER.stop(), t_start, t_end, dist.is_initialized()))
    destroy_process_group()



if __name__ == "__main__":
    main()
