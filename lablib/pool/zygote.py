"""A fork server for ranks: one process, started with the first pool, that has imported torch and forks
each new rank from itself.

Why: a rank started from scratch pays ``import torch`` (1-3 s on 2 cores, more when 4 start at once),
and a notebook starts pools again and again (its own, a spare one of another size for a check, one
after a kernel restart). Forked from a process that has imported torch, a rank is ready in tens of
milliseconds. The server forks only: it never runs a torch op, never touches CUDA, and starts no
threads, so a child inherits no thread that holds a lock (forking a process that has computed with
torch hangs the child in OpenMP).

The parent side (``spawn``) returns a ``Proc`` that stands in for ``subprocess.Popen``: ``pid``,
``poll()``, ``wait(timeout)``, ``send_signal``, ``kill``, ``returncode`` and the ``stdout``/``stderr``
pipes. The server reports each child's exit status, as a parent's ``waitpid`` would see it. It dies
with its parent (PR_SET_PDEATHSIG, as the ranks do), and the ranks with it.
"""
from __future__ import annotations

import array
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading

# What a rank imports before its first job: importing it here once is what the server is for.
PRELOAD = ("torch", "torch.distributed", "numpy", "cloudpickle", "lablib.pool.worker", "lablib.comm",
           "lablib.timeline")


# -- the parent's side ---------------------------------------------------------------------------------
class Proc:
    """A rank forked by the server, with the part of ``subprocess.Popen`` the pool uses."""

    def __init__(self, pid: int, stdout, stderr):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._gone = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._gone.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._gone.set()


class _Forked:
    """The server when this process forked it (``start_here``): as much of Popen as ``Server`` uses."""

    def __init__(self, pid: int):
        self.pid, self._code = pid, None

    def poll(self):
        if self._code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code


class Server:
    """The fork server of this process (``server()``): asks it for ranks and hears when they exit.
    ``fork``: fork it from this process, which must be one thread that has run no torch op yet
    (``start_here``); else it starts afresh and imports ``PRELOAD``."""

    def __init__(self, fork: bool = False):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if fork:
            parent, pid = os.getpid(), os.fork()
            if pid == 0:
                ours.close()
                os.setsid()
                serve(theirs.fileno(), parent)  # never returns
            self.proc = _Forked(pid)
        else:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from lablib.pool.zygote import serve; serve({theirs.fileno()}, {os.getpid()})"],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._sock, self._lock = ours, threading.Lock()
        self._procs: dict[int, Proc] = {}
        self._replies: list = []
        self._reply = threading.Condition()
        threading.Thread(target=self._read, name="lablib-zygote", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, env: dict, cwd: str, path: list[str]) -> Proc:
        """A new rank: forked with ``env`` as its environment, in ``cwd``, with ``path`` ahead of its
        sys.path; its stdout and stderr are pipes read here."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self._lock:
                _send(self._sock, pickle.dumps(("spawn", env, cwd, path)), [out_w, err_w])
                with self._reply:
                    while not self._replies and self.alive:
                        self._reply.wait(1.0)
                    if not self._replies:
                        raise RuntimeError("lablib's rank server exited; restart the kernel")
                    pid = self._replies.pop(0)
                proc = self._procs[pid] = Proc(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
        finally:
            os.close(out_w)
            os.close(err_w)
        return proc

    def _read(self):
        buf = b""
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:  # the server is gone, and its ranks with it (PR_SET_PDEATHSIG)
                for proc in self._procs.values():
                    if proc.returncode is None:
                        proc._exited(-signal.SIGKILL)
                with self._reply:
                    self._reply.notify_all()
                return
            buf += data
            while len(buf) >= 12:
                kind, pid, code = struct.unpack("!iii", buf[:12])
                buf = buf[12:]
                if kind == 0:
                    with self._reply:
                        self._replies.append(pid)
                        self._reply.notify_all()
                elif pid in self._procs:
                    self._procs.pop(pid)._exited(code)


def usable() -> bool:
    """Whether ranks are forked from the server: on Linux (macOS's system libraries do not survive a fork
    without exec), unless LABLIB_FORK=0 (ranks are then started from scratch, each importing torch)."""
    return sys.platform.startswith("linux") and os.environ.get("LABLIB_FORK", "1") != "0"


def start(env: dict, cwd: str, path: list[str]):
    """A new rank process, with ``env``, in ``cwd``, ``path`` ahead of its sys.path, its stdout and stderr
    piped here: forked from the server where ``usable()``, else started from scratch."""
    if usable():
        return server().spawn(env, cwd, path)
    return subprocess.Popen(
        [sys.executable, "-c", "from lablib.pool.worker import main; main()"], cwd=cwd,
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # Own session: the terminal's Ctrl-C or Jupyter's interrupt reach the parent only, which then
        # stops the ranks in order.
        start_new_session=True)


_SERVER: list = []
_SERVER_LOCK = threading.Lock()


def server() -> Server:
    """This process's fork server, started on first use (and again if it died)."""
    with _SERVER_LOCK:
        if not _SERVER or not _SERVER[0].alive:
            _SERVER[:] = [Server()]
        return _SERVER[0]


def start_here() -> None:
    """Make this process's fork server a fork of this process, which has imported torch already, so the
    server costs no import of its own. Only for a process that is one thread and has run no torch op
    (the grading box's runner, at its start); a notebook's kernel has threads of its own."""
    if not usable() or threading.active_count() > 1:
        return
    for name in PRELOAD:
        __import__(name)
    with _SERVER_LOCK:
        if not _SERVER or not _SERVER[0].alive:
            _SERVER[:] = [Server(fork=True)]


def _send(sock, data: bytes, fds: list[int]) -> None:
    sock.sendmsg([struct.pack("!i", len(data)) + data],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


# -- the server ----------------------------------------------------------------------------------------
def serve(fd: int, parent: int) -> None:
    """The server's loop: fork a rank per request, report each rank's pid and exit status, until the
    parent (``parent``) is gone."""
    import importlib
    import select

    _kill_me_with_my_parent()
    records = os.environ.pop("LABLIB_RECORDS_FD", None)  # a grading box's records pipe (course/executor.py):
    if records:                                           # no rank holds it
        os.close(int(records))
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [], 0.5)
        if os.getppid() != parent:  # re-parented: the parent is gone (where PR_SET_PDEATHSIG is not)
            os._exit(0)
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock in ready:
            head = _recv_request(sock)
            if head is None:
                os._exit(0)  # the parent closed its end
            request, fds = head
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                _child(request, fds)  # never returns
            for f in fds:
                os.close(f)
            sock.sendall(struct.pack("!iii", 0, pid, 0))
            _reap(sock)


def _kill_me_with_my_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel sends SIGKILL the moment the parent dies (Linux; elsewhere the loop
    sees it re-parented within half a second)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _reap(sock) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sock.sendall(struct.pack("!iii", 1, pid, code))


def _recv_request(sock):
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(4, socket.CMSG_LEN(2 * fds.itemsize))
    if not data:
        return None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    (size,) = struct.unpack("!i", data)
    body = b""
    while len(body) < size:
        body += sock.recv(size - len(body))
    return pickle.loads(body), list(fds)


def _child(request, fds) -> None:
    _, env, cwd, path = request
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # as start_new_session: the terminal's Ctrl-C reaches the parent only
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in (null, *fds):
            os.close(f)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env, LABLIB_SERVER_PID=str(os.getppid()))  # a rank dies with the server
        sys.path[:0] = [p for p in path if p not in sys.path]
        from .worker import main

        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank's last words, on its stderr
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
