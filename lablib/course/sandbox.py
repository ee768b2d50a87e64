"""Running untrusted code (a learner's exercises, during ``lablib grade``) in a box made by bubblewrap.

What the box sees: the system directories Python needs (/usr, /bin, /sbin, /lib*, /etc, less the usual
secrets in /etc), the base interpreter (``sys.base_prefix``), the paths the caller lists, read-only at
their own paths, overlays (a host directory shown read-only at another path), and the work dir,
read-write at its own path. /tmp and /dev/shm are private and start empty; every other write fails.
It has no network but loopback, its own process ids, a clean environment, and runs as user 65534
(nobody) with no capabilities; outside, its files and processes belong to the grader's user. When the
command ends or runs out of time, everything it started is killed before ``run`` returns.

``scratch``: the work dir is then no host directory but a private tmpfs of that size at the same path (and
/tmp and /dev/shm are ones of that size too), so nothing the box writes reaches the host's disk; where
bwrap cannot size a tmpfs (before 0.7) it is charged to the memory limit. ``stdin`` is fed to the command,
and ``channel`` opens a pipe back (its fd in LABLIB_RESULTS_FD) whose first ``channel`` bytes come back in
``Result.data``: what a box hands back need not touch a disk either.

Limits: the wall time always. Memory, processes (threads count) and CPU time through a child cgroup (v2, or
v1's memory, pids and cpu hierarchies) where this process may make one; else memory per process with RLIMIT_AS
and no process limit, as RLIMIT_NPROC does not bind root and counts all of a user's processes.
``Result.enforced`` lists what held.

Without a working bwrap the command runs unboxed, in its own session, with the same limits, and the
result carries a warning for the report. LABLIB_SANDBOX=off forces that; LABLIB_SANDBOX=require makes
a missing sandbox an error (SandboxError).
"""
from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from .cgroup import GONE_S, _Cgroup, _size

OUTPUT_CHARS = 20000
BOX_USER = 65534
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Outside, the box's user is the grader's: when that is root, root-only files in the box are readable.
SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/ssl/private")
_EMPTY: Mapping = MappingProxyType({})
# Joins the cgroups listed before "--", then runs the rest: the command starts inside its limits.
_JOIN = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'


class SandboxError(RuntimeError):
    """No box where one is required (LABLIB_SANDBOX=require), or a run asked for something impossible."""


@dataclass
class Limits:
    """What one run may use; past a limit it is killed (``Result.reason`` says which)."""
    seconds: float                      # total wall time
    memory_bytes: int | None = 8 << 30  # all processes together (cgroup), or each one (rlimit)
    processes: int | None = 256         # processes and threads together; only with a cgroup
    cpus: float | None = None           # CPU time, in cores' worth (a quota); only with a cgroup


@dataclass
class Result:
    """How a run ended, its output, and what held it: put ``warning`` in the report when it is set."""
    returncode: int | None    # None when killed by the timeout; -N when killed by signal N
    output: str               # stdout and stderr, the last 20000 characters
    reason: str               # "" when it exited by itself, else e.g. "timed out after 30 s"
    boxed: bool
    enforced: tuple[str, ...]  # e.g. ("pid namespace", "no network", "memory 8 GiB (cgroup v2)")
    warning: str = ""         # for the report when the command ran unboxed
    data: bytes = b""         # what came over the channel (``run(channel=...)``), at most its cap
    data_over: bool = False   # the box wrote more than the cap to the channel: ``data`` is cut there


_probe: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "") when bubblewrap can make a box here, else (False, why not). The first call starts a box
    that runs ``true`` (the same namespaces and mounts as a real one); the answer is kept."""
    global _probe
    if _probe is None:
        _probe = _try_bwrap()
    return _probe


def _try_bwrap() -> tuple[bool, str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False, "bwrap is not installed"
    try:
        done = subprocess.run([*_box_args(bwrap, [], {}, Path("/")), "true"], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "bwrap did not start a box within 60 s"
    if done.returncode != 0:
        said = (done.stderr + done.stdout).strip() or f"exit status {done.returncode}"
        return False, f"bwrap cannot make a box here ({said})"
    return True, ""


def run(argv: list[str], *, workdir: Path, readonly: Sequence[Path] = (), overlays: Mapping[Path, Path] = _EMPTY,
        env: Mapping[str, str] = _EMPTY, limits: Limits, cwd: Path | None = None, scratch: int | None = None,
        stdin: bytes | None = None, channel: int | None = None) -> Result:
    """Run ``argv`` in a box and wait for it, at most ``limits.seconds``.

    ``workdir`` is the only writable host directory (at its own path; HOME points at it), or with ``scratch``
    a private tmpfs of that many bytes at that path; ``readonly`` paths are seen at their own paths,
    ``overlays`` maps a path in the box to the host directory shown there. The environment is ``env`` plus
    PATH, HOME and LANG unless ``env`` sets them. ``cwd`` (default: the work dir) is a path as the box sees
    it. ``stdin``: bytes the command reads on its standard input; ``channel``: a byte cap on the pipe whose
    write end is fd LABLIB_RESULTS_FD in the command (``Result.data``)."""
    mode = os.environ.get("LABLIB_SANDBOX") or "auto"
    if mode not in ("auto", "off", "require"):
        raise SandboxError(f"LABLIB_SANDBOX={mode} is not understood: set it to off or require, or unset it")
    boxed, why = (False, "LABLIB_SANDBOX=off") if mode == "off" else available()
    if not boxed and mode == "require":
        raise SandboxError(f"LABLIB_SANDBOX=require, but there is no sandbox: {why}. "
                           "Install bubblewrap (apt-get install bubblewrap).")
    workdir = Path(workdir).absolute()
    for path in [workdir, *readonly, *overlays.values()]:
        if not Path(path).exists():
            raise SandboxError(f"{path} does not exist, so it cannot be shown in the box")
    cwd = Path(cwd).absolute() if cwd else workdir
    env = {"PATH": DEFAULT_PATH, "HOME": str(workdir), "LANG": "C.UTF-8", **env}
    cgroup = _Cgroup.make(limits.memory_bytes, limits.processes, limits.cpus)
    back = os.pipe() if channel is not None else None  # _supervise closes both ends
    if back:
        env["LABLIB_RESULTS_FD"] = str(back[1])
    try:
        prefix, enforced = _limit_prefix(cgroup, limits)
        if boxed:
            info = os.pipe()
            binds = [("--ro-bind", p, p) for p in _interpreter_dirs()]
            binds += [("--ro-bind", p, p) for path in readonly for p in _as_given_and_real(path)]
            binds += [("--ro-bind", Path(src), Path(dest).absolute()) for dest, src in overlays.items()]
            if scratch is None:
                binds += [("--bind", p, p) for p in _as_given_and_real(workdir)]
            else:
                binds += [(*_sized(scratch), "--tmpfs", workdir)]
                enforced.append(f"writes: {_size(scratch)} of private tmpfs" + ("" if _bwrap_sizes() else
                                                                                " (charged to the memory limit)"))
            command = [*prefix, *_box_args(shutil.which("bwrap"), binds, env, cwd, info_fd=info[1], tmp=scratch),
                       *argv]
            enforced = ["filesystem: only the given paths", "pid namespace", "no network",
                        f"time {limits.seconds:g} s", *enforced]
            returncode, output, timed_out, data = _supervise(command, env, None, limits.seconds, info, stdin, back,
                                                             channel)
            if returncode is not None and 128 < returncode <= 128 + 64:
                returncode = 128 - returncode  # bwrap reports signal N as 128 + N; subprocess says -N
        else:
            enforced = [f"time {limits.seconds:g} s (process group)", *enforced]
            returncode, output, timed_out, data = _supervise([*prefix, *argv], env, cwd, limits.seconds, None, stdin,
                                                             back, channel)
        out_of_memory = cgroup is not None and cgroup.oom_kills() > 0
    finally:
        if cgroup:
            cgroup.remove()

    if timed_out:
        returncode, reason = None, f"timed out after {limits.seconds:g} s"
    elif out_of_memory and returncode != 0:
        reason = f"killed: out of memory ({_size(limits.memory_bytes)} limit)"
    elif returncode < 0:
        reason = f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    else:
        reason = ""
    warning = "" if boxed else (
        f"grading ran WITHOUT a sandbox: {why}. The learner code could read and change every file of the "
        "grader's user, and use the network. "
        + ("Unset LABLIB_SANDBOX to use bubblewrap." if mode == "off" else
           "Install bubblewrap (apt-get install bubblewrap)."))
    return Result(returncode, output, reason, boxed, tuple(enforced), warning, bytes(data[:channel or 0]),
                  channel is not None and len(data) > channel)


def _limit_prefix(cgroup: _Cgroup | None, limits: Limits) -> tuple[list[str], list[str]]:
    """What to run before the command (each part execs the next, in one process) to set its limits,
    and the limits that hold."""
    prefix, enforced = [], []
    setpriv = shutil.which("setpriv")
    if setpriv:  # the kernel kills the run when the grader dies
        prefix += [setpriv, "--pdeathsig", "KILL", "--"]
    prlimit = shutil.which("prlimit")
    if cgroup:
        prefix += ["/bin/sh", "-c", _JOIN, "sh", *cgroup.procs_files(), "--"]
        enforced += cgroup.enforced
    elif limits.memory_bytes and prlimit:
        prefix += [prlimit, f"--as={limits.memory_bytes}", "--"]
        enforced.append(f"memory {_size(limits.memory_bytes)} per process (rlimit)")
    return prefix, enforced


def _bwrap_sizes() -> bool:
    """Whether the installed bwrap sizes a tmpfs (``--size``, bubblewrap 0.7 and later)."""
    return _bwrap_help().find("--size") >= 0


@functools.cache
def _bwrap_help() -> str:
    try:
        return subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _sized(size: int | None) -> tuple[str, ...]:
    """bwrap's arguments that size the next tmpfs, where it can."""
    return ("--size", str(size)) if size is not None and _bwrap_sizes() else ()


def _box_args(bwrap: str, binds: list[tuple], env: Mapping[str, str], cwd: Path, info_fd: int | None = None,
              tmp: int | None = None) -> list[str]:
    """bwrap's command line up to the command: namespaces, then the mounts in order (a later mount covers
    an earlier one), then the root made read-only. ``tmp``: the size of the box's /tmp and /dev/shm (default:
    /tmp is tmpfs's default, /dev/shm part of /dev's)."""
    args = [bwrap, "--unshare-user", "--uid", str(BOX_USER), "--gid", str(BOX_USER), "--unshare-pid",
            "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv"]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    for name, value in env.items():
        args += ["--setenv", name, value]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in SECRETS:
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.isfile(path):
            args += ["--ro-bind", "/dev/null", path]
    args += ["--proc", "/proc", "--dev", "/dev", *_sized(tmp), "--tmpfs", "/tmp"]
    if tmp is not None:  # --dev's /dev/shm is a folder of its tmpfs, which no size caps
        args += [*_sized(tmp), "--tmpfs", "/dev/shm"]
    for bind in binds:
        args += [str(part) for part in bind]
    return args + ["--remount-ro", "/", "--chdir", str(cwd), "--"]


@functools.cache
def _interpreter_dirs() -> list[Path]:
    """The base interpreter's prefixes when they lie outside the system directories (pyenv, conda):
    a virtual environment's python is a link to it."""
    system = [Path(p).resolve() for p in SYSTEM_DIRS if os.path.exists(p)]
    dirs = {Path(sys.base_prefix).resolve(), Path(sys.base_exec_prefix).resolve()}
    return sorted(d for d in dirs if not any(d == s or s in d.parents for s in system))


def _as_given_and_real(path: Path) -> list[Path]:
    """A path as given, and where its links lead if elsewhere: files inside may name either."""
    given, real = Path(path).absolute(), Path(path).resolve()
    return [given] if given == real else [given, real]


def _supervise(command: list[str], env: Mapping[str, str], cwd: Path | None, seconds: float,
               info: tuple[int, int] | None, stdin: bytes | None = None, back: tuple[int, int] | None = None,
               cap: int | None = None) -> tuple[int | None, str, bool, bytearray]:
    """Run the command in its own session and collect its output until it exits or the time is up;
    then kill its process group and, for a box, the box's init (so its whole pid namespace), and wait
    until they are gone. ``info``: the pipe given to bwrap's --info-fd (closed here); ``stdin``: fed to the
    command; ``back``: a pipe whose write end the command holds, read here up to ``cap`` bytes and one more
    (closed here). Returns (exit status, output, timed out, what came over ``back``)."""
    deadline = time.monotonic() + seconds
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
                                start_new_session=True, pass_fds=(info[1:] if info else ()) + (back[1:] if back else ()))
    except BaseException:
        for fd in ((info[0],) if info else ()) + (back[:1] if back else ()):
            os.close(fd)
        raise
    finally:
        for fd in ((info[1],) if info else ()) + (back[1:] if back else ()):
            os.close(fd)
    if stdin is not None:  # fed from a thread: the command may write output before it has read it all
        threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True, name="lablib-box-stdin").start()
    exited = os.pidfd_open(proc.pid)  # readable once it exits; it stays unreaped, so its group id is safe
    out = proc.stdout.fileno()
    tail, timed_out, box_init, data = bytearray(), False, None, bytearray()
    channel = back[0] if back else None
    try:
        if info:
            box_init = _box_init(info[0], deadline)
            os.close(info[0])
            info = None
        watch = [out, exited] + ([channel] if back else [])
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready = select.select(watch, [], [], left)[0]
            if exited in ready:
                break
            if out in ready:
                chunk = os.read(out, 1 << 16)
                if not chunk:
                    watch.remove(out)
                _keep(tail, chunk)
            if channel in ready and not _take(channel, data, cap):
                watch.remove(channel)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if box_init is not None:
            try:
                signal.pidfd_send_signal(box_init, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(GONE_S)
        if box_init is not None:  # the box's init exits after every process in its namespace
            select.select([box_init], [], [], GONE_S)
            os.close(box_init)
        os.close(exited)
        if info:
            os.close(info[0])
        _drain(out, tail)
        proc.stdout.close()
        if back:
            while select.select([channel], [], [], 0)[0] and _take(channel, data, cap):
                pass
            os.close(channel)
    text = tail.decode(errors="replace")[-OUTPUT_CHARS:]
    return proc.returncode, text, timed_out, data


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the command ended, or closed its stdin, before reading it all
        pass


def _take(fd: int, data: bytearray, cap: int | None) -> bool:
    """Read what the channel holds into ``data``, kept to ``cap`` bytes and one more (which says it went over);
    False at its end."""
    chunk = os.read(fd, 1 << 16)
    if cap is None or len(data) <= cap:
        data += chunk[:cap + 1 - len(data)] if cap is not None else chunk
    return bool(chunk)


def _box_init(fd: int, deadline: float) -> int | None:
    """A pidfd for the box's init (pid 1 inside, bwrap's child), from what bwrap writes to --info-fd
    before the command starts; None when bwrap failed first."""
    data = b""
    while b"}" not in data and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return os.pidfd_open(json.loads(data)["child-pid"])
    except (ValueError, KeyError, ProcessLookupError):
        return None


def _keep(tail: bytearray, chunk: bytes):
    tail += chunk
    if len(tail) > 8 * OUTPUT_CHARS:  # UTF-8: at most 4 bytes a character
        del tail[:-4 * OUTPUT_CHARS]


def _drain(fd: int, tail: bytearray):
    """Read what is left of the output; give up after 1 s on a writer that outlived the run (possible
    only unboxed and without a cgroup)."""
    end = time.monotonic() + 1.0
    while select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        _keep(tail, chunk)


